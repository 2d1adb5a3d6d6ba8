"""TinyViT, DaViT, Twins-SVT, NesT and Hiera (timm.models.tiny_vit, davit, twins, nest,
hiera): their adapters against timm's own modules and models, float64 as the referee, and
the patcher's promises for them.

timm is the oracle: its unpatched modules, every parameter perturbed (verify.perturb_:
TinyViT's zero-initialized bias tables N(0, 1), the rest moved off their initialization).
Under the interpreter the configurations are tiny (one or two blocks a stage, 64x64 images
whose maps are padded to whole windows); the GPU tests run the models as timm makes them.
"""
import copy

import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from model_checks import (compiled_against_timm, every_model_patched, full_resolution_passes, judge, patched_in_place,
                          training_step_runs)
from model_cases import flashwin_ops, images, recording_backend
from opcases import relative_error
from timm_flashwin import PatchError, is_patched, patch_model, patch_report
from timm_flashwin.patching.adapters import hiera as hiera_adapter
from timm_flashwin.tools.comparison import compare
from timm_flashwin.tools.verify import build_model, perturb_, verify_model

M = timm.models
CLASSES = {"tiny_vit": M.tiny_vit.Attention, "davit": M.davit.WindowAttention, "twins": M.twins.LocallyGroupedAttn,
           "nest": M.nest.Attention, "hiera": M.hiera.MaskUnitAttention}

#: family -> (timm model, overrides, image size): a training step against timm's (verify_model)
MODELS = {
    # stage maps 8x8 in 3x3 windows (padded to 9x9), 4x4 = its one window (not partitioned), 2x2 padded to 3x3
    "tiny_vit": ("tiny_vit_5m_224", dict(embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2),
                                         window_sizes=(7, 3, 4, 3)), 64),
    # 16x16 padded to 21x21 (nine 7x7 windows), 8x8 padded to 14x14
    "davit": ("davit_tiny", dict(depths=(1, 1), embed_dims=(32, 64), num_heads=(1, 2)), 64),
    # the same maps in the locally-grouped blocks (the next block of each stage would be global)
    "twins": ("twins_svt_small", dict(embed_dims=(32, 64), num_heads=(1, 2), depths=(1, 1), wss=(7, 7),
                                      sr_ratios=(2, 1), mlp_ratios=(2, 2)), 64),
    # 8x8 mask units, 4x4 ones, global attention; three blocks pool their queries (q_stride 4)
    "hiera": ("hiera_tiny_224", dict(embed_dim=32, num_heads=1, stages=(1, 2, 2, 1)), 64),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_patched_model_matches_timm(family):
    """A training step (float32, the kernels): every attention module's output, the model's
    and every parameter gradient against timm's, with verify's rule."""
    name, overrides, size = MODELS[family]
    result = verify_model(name, img_size=size, batch=1, train=True, model_kwargs=overrides)
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.patched_modules == len(result.layers) >= 2
    if family == "hiera":  # the three q-pooling blocks among them
        assert sum(m.q_stride > 1 for m in build_model(name, img_size=size, model_kwargs=overrides).modules()
                   if isinstance(m, CLASSES["hiera"])) == 3
    with torch.device("meta"):
        assert {m.family for m in patch_report(timm.create_model(name, **overrides)).modules} == {family}


def test_nest_model_matches_timm():
    """NesT's factory fixes its widths and depths: a small Nest (three levels, blocks of 4x4
    tokens) built from its class, a training step against timm's with verify's rule."""
    torch.manual_seed(0)
    model = perturb_(M.nest.Nest(img_size=32, patch_size=2, embed_dims=(16, 32, 32), num_heads=(1, 1, 2),
                                 depths=(1, 1, 1), num_classes=10)).train()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(1, (32, 32))
    runs = training_step_runs(model, ours, x)
    assert len(patch_report(ours).patched) == 3 and len(runs[2][1]) == len(list(model.parameters()))
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))


# ------------------------------------------------------------------------- modules
#: case -> family
MODULE_CASES = {"tiny_vit": "tiny_vit", "davit": "davit", "twins": "twins", "twins_padded": "twins", "nest": "nest",
                "hiera": "hiera", "hiera_global": "hiera", "hiera_pooling": "hiera", "hiera_global_pooling": "hiera"}


def case_inputs(case: str, x: torch.Tensor):
    """The call's arguments of a ``module_case`` module, from x (B, 36, 32)."""
    return {"tiny_vit": (x[:, :15],),  # a non-square 3x5 window
            "davit": (x[:, :16],),  # a 4x4 window
            "twins": (x, (6, 6)),  # the 36 tokens as a 6x6 map: four 3x3 windows
            "twins_padded": (x, (6, 6)),  # 4x4 windows: padded to 8x8
            "nest": (x.reshape(x.shape[0], 3, 12, 32),),  # 3 blocks of 12 tokens
            # 4 mask units of 9 tokens; one window of 36; 3 units of 12 tokens pooled to 3 queries
            # each; 36 tokens pooled to 9 queries
            "hiera": (x,), "hiera_global": (x,), "hiera_pooling": (x,), "hiera_global_pooling": (x,)}[case]


def module_case(case: str, **kwargs) -> nn.Module:
    """A perturbed timm module of ``case`` (32 channels in, 2 heads); kwargs: its dropout."""
    torch.manual_seed(0)
    module = {"tiny_vit": lambda: M.tiny_vit.Attention(32, 16, 2, attn_ratio=1, resolution=(3, 5)),
              "davit": lambda: M.davit.WindowAttention(32, (4, 4), 2),
              "twins": lambda: M.twins.LocallyGroupedAttn(32, 2, ws=3, **kwargs),
              "twins_padded": lambda: M.twins.LocallyGroupedAttn(32, 2, ws=4, **kwargs),
              "nest": lambda: M.nest.Attention(32, 2, qkv_bias=True, **kwargs),
              "hiera": lambda: M.hiera.MaskUnitAttention(32, 48, 2, window_size=9, use_mask_unit_attn=True),
              "hiera_global": lambda: M.hiera.MaskUnitAttention(32, 32, 2, window_size=9),
              "hiera_pooling": lambda: M.hiera.MaskUnitAttention(32, 48, 2, q_stride=4, window_size=3,
                                                                 use_mask_unit_attn=True),
              "hiera_global_pooling": lambda: M.hiera.MaskUnitAttention(32, 32, 2, q_stride=4, window_size=1)}[case]()
    return perturb_(module)


def some_x(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 36, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case, recompute_qkv", [(c, False) for c in MODULE_CASES] + [("tiny_vit", True)] + [
    (c, True) for c in MODULE_CASES if c != "tiny_vit"])
def test_module_matches_timm(case, recompute_qkv, monkeypatch):
    """Each class and layout in training mode: output and every gradient (input and
    parameters) against timm's module in float32 and float64, verify's rule; with
    recompute_qkv too (the qkv projection, Twins' padding and Hiera's unit order, recomputed
    in the backward). Hiera's global case with recompute_qkv as if its 36 tokens were more
    than the window kernels take: the local operator's road, as the pooling cases'."""
    if (case, recompute_qkv) == ("hiera_global", True):
        monkeypatch.setattr(hiera_adapter, "WINDOW_OP_TOKENS", 16)
    module = module_case(case)
    ours = patch_model(copy.deepcopy(module), strict=True, recompute_qkv=recompute_qkv)
    results = []
    for net, dtype in ((ours, torch.float32), (module, torch.float32), (copy.deepcopy(module), torch.float64)):
        net = net.to(KERNEL_DEVICE, dtype)
        net.train()  # TinyViT's train() returns None
        x = some_x().to(KERNEL_DEVICE, dtype).requires_grad_()
        out = net(*case_inputs(case, x))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out))
        results.append([out, x.grad] + [p.grad for p in net.parameters()])
    assert is_patched(ours) and len(results[0]) == len(results[2]) >= 4
    for i, (got, timm_out, ref) in enumerate(zip(*results)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        comparison = compare(str(i), got, timm_out, ref, 1e-4, 1e-6)
        assert comparison.passed, comparison


class OneOfEach(nn.Module):
    """A module of each case of ``families``' classes, each called on x (B, 36, 32)."""

    def __init__(self, families=tuple(CLASSES)):
        super().__init__()
        self.parts = nn.ModuleDict({case: module_case(case) for case, family in MODULE_CASES.items()
                                    if family in families and case != "twins"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 36, 32) -> every module's output, flattened, side by side (B, ...)."""
        return torch.cat([module(*case_inputs(case, x)).flatten(1) for case, module in self.parts.items()], 1)


# ----------------------------------------------------------------------- every model's modules
@pytest.fixture
def no_tiny_vit_index(monkeypatch):
    """On the meta device TinyViT's bias index holds no values, yet timm fills it in Python
    loops over every pair of window tokens (1M for tiny_vit_21m_512: 5 s): not filled."""
    monkeypatch.setattr(M.tiny_vit.Attention, "_init_buffers", lambda self: None)


def test_every_registered_model_is_patched_or_reported_on_meta(no_tiny_vit_index):
    """Every window-attention module of every model of the five files (built on the meta
    device) patched, strict, Hiera's q-pooling ones too; the models without such modules are
    Twins' pcpvt ones (no locally-grouped attention)."""
    for family, attention in CLASSES.items():
        names = timm.list_models(module=family)
        served = [name for name, _ in every_model_patched(names, attention, (family,))]
        assert all(name.startswith("twins_pcpvt") for name in set(names) - set(served)), family


def test_list_shows_families_and_windows(no_tiny_vit_index):
    """``timm-flashwin list``'s rows (discovery.supported_models): family, windows, modules."""
    from timm_flashwin.tools.discovery import supported_models
    rows = {i.name: i for i in supported_models("tiny_vit_21m_512")
            + supported_models("hiera_tiny_224") + supported_models("twins_svt_s*") + supported_models("nest_t*")}
    assert set(rows) == {"tiny_vit_21m_512", "hiera_tiny_224", "twins_svt_small", "nest_tiny", "nest_tiny_jx"}
    assert rows["tiny_vit_21m_512"].stage_windows == [(16, 16), (32, 32), (16, 16)]  # 1024 tokens
    # no stage containers: each window once (a q-pooling module's: its keys')
    assert (rows["hiera_tiny_224"].stage_windows, rows["hiera_tiny_224"].modules) == ([(8, 8), (4, 4), None], 12)
    assert rows["twins_svt_small"].stage_windows == [(7, 7)] * 4 and rows["twins_svt_small"].families == ["twins"]
    assert rows["nest_tiny"].stage_windows == [None] * 3 and rows["nest_tiny"].modules == 12


# ------------------------------------------------------------------------ behaviour
def test_state_dict_unpatch_deepcopy_script_and_torch_save():
    model = OneOfEach().eval().to(KERNEL_DEVICE)
    x = some_x().to(KERNEL_DEVICE)
    with patched_in_place(model, x, patched=8) as (expected, patched_out):
        assert all(f"flashwin={MODULE_CASES[case]}" in repr(module) for case, module in model.parts.items())
        for case in ("tiny_vit", "twins_padded"):  # the patched forwards of x alone and of Twins' (x, size)
            module = model.parts[case]  # TorchScript compiles timm's forward
            torch.testing.assert_close(torch.jit.script(module)(*case_inputs(case, x)),
                                       module._flashwin_timm_forward(*case_inputs(case, x)), rtol=1e-6, atol=1e-7)
    assert not torch.equal(patched_out, expected)  # the kernels really ran while patched
    torch.testing.assert_close(patched_out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("families, train", [
    (tuple(CLASSES), False), (("tiny_vit",), True),
    (("davit", "twins", "nest", "hiera"), True)])
def test_compiles_without_graph_break(families, train):
    """torch.compile(fullgraph=True): one graph that calls the op once per module and holds
    no softmax nor SDPA of timm's; its output and gradients are the eager patched model's."""
    model = patch_model(OneOfEach(families), strict=True).train(train).to(KERNEL_DEVICE)
    x = some_x().to(KERNEL_DEVICE).requires_grad_(train)
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.set_grad_enabled(train):
            out = net(x)
            if train:
                out.square().sum().backward()
        results.append([out.detach()] + ([x.grad] + [p.grad for p in model.parameters()] if train else []))
    assert len(graphs) == 1 and flashwin_ops(graphs) == len(model.parts)
    assert not any("softmax" in t or "scaled_dot_product" in t for t in graphs[0])
    for compiled, eager in zip(*results):
        assert relative_error(compiled, eager) < 1e-5


def test_float64_and_plain_cpu_run_timms_math():
    """float64 (and any tensor the kernels do not take) computes in PyTorch: timm's values."""
    model = OneOfEach().double().eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(some_x().double()), model(some_x().double()), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["twins_padded", "nest"])
def test_attention_dropout_runs_in_the_kernel(case, monkeypatch):
    """attn_drop > 0 (Twins, NesT; the other three have none): applied by the kernels in
    training mode (p read at call time), not in eval mode; torch.manual_seed reproduces a step."""
    module = module_case(case, attn_drop=0.25).to(KERNEL_DEVICE)
    timm_module = copy.deepcopy(module)
    patch_model(module, strict=True)
    import timm_flashwin.patching.adapters.base as base
    real, calls = base.window_attention, []
    monkeypatch.setattr(base, "window_attention", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    x = some_x().to(KERNEL_DEVICE)
    with torch.no_grad():
        evaluated = module.eval()(*case_inputs(case, x))
        torch.testing.assert_close(evaluated, timm_module.eval()(*case_inputs(case, x)), rtol=1e-4, atol=1e-5)
    steps = []
    for _ in range(2):
        module.zero_grad()
        torch.manual_seed(5)
        out = module.train()(*case_inputs(case, x))
        out.square().sum().backward()
        steps.append([out.detach()] + [p.grad.clone() for p in module.parameters()])
    assert calls == [0.0, 0.25, 0.25]
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert not torch.allclose(steps[0][0], evaluated, rtol=1e-3, atol=1e-3)


def test_reasons_in_the_report_and_strict_mode():
    """TinyViT with values wider than keys (attn_ratio 2), a head_dim over 256, a subclass:
    reported, strict raises."""
    model = nn.Sequential(M.tiny_vit.Attention(32, 16, 2, attn_ratio=2, resolution=(4, 4)),
                          M.davit.WindowAttention(288, (4, 4), 1), type("MyNest", (M.nest.Attention,), {})(32))
    patch_model(model)
    assert {m.name: m.reason for m in patch_report(model).skipped} == {
        "0": "val_dim 32 is not key_dim 16 (attn_ratio 2): the op takes q, k and v of one head_dim",
        "1": "head_dim 288 is not in [1, 256]", "2": "MyNest subclasses timm's class; its forward may differ"}
    with pytest.raises(PatchError, match="attn_ratio 2"):
        patch_model(model, strict=True)


def test_bad_input_to_patched_modules():
    parts = patch_model(OneOfEach()).parts
    with pytest.raises(ValueError, match=r"expected N = 3\*5 = 15 tokens per window, got 16"):
        parts["tiny_vit"](torch.randn(2, 16, 32))
    with pytest.raises(ValueError, match=r"size \(6, 5\) is not the map of the 36 tokens"):
        parts["twins_padded"](torch.randn(2, 36, 32), (6, 5))
    with pytest.raises(ValueError, match=r"expected x of shape \(B, T, N, C\) with C = 32"):
        parts["nest"](torch.randn(2, 36, 32))
    with pytest.raises(ValueError, match=r"expected N a multiple of the mask unit's 9 tokens, got 35"):
        parts["hiera"](torch.randn(2, 35, 32))


def test_tiny_vit_bias_is_read_at_call_time():
    """In-place edits of TinyViT's bias table between cached inference calls take effect
    (timm's own eval cache would not see them: its training mode computes the bias anew)."""
    module = module_case("tiny_vit")
    ours = patch_model(copy.deepcopy(module), strict=True)
    ours.eval()  # TinyViT's train() returns None
    x = case_inputs("tiny_vit", some_x())[0]
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ours(x), module(x), rtol=1e-4, atol=1e-5)
            for net in (module, ours):
                net.attention_biases.mul_(-2.0)


# ------------------------------------------------------------------------ GPU only
GPU_MODELS = ["tiny_vit_21m_224", "tiny_vit_21m_512", "davit_tiny", "davit_base_fl", "twins_svt_small", "nest_tiny",
              "hiera_tiny_224", "hiera_base_abswin_256"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", GPU_MODELS)
def test_gpu_full_resolution_autocast(name, dtype):
    """Full resolution, AMP, forward and every gradient: windows of 16 to 1024 tokens
    (TinyViT-512's 32x32), Hiera's global attention over 196 and 256."""
    full_resolution_passes(name, dtype, kept=0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tiny_vit_21m_224", "davit_tiny", "twins_svt_small", "nest_tiny", "hiera_tiny_224"])
def test_gpu_torch_compile_inference_and_training(name):
    """torch.compile(fullgraph=True, inductor) of the patched model, float32: the eval output
    and a training step's gradients against timm's (model_checks.compiled_against_timm)."""
    torch.manual_seed(0)
    failed = compiled_against_timm(perturb_(timm.create_model(name, drop_path_rate=0.0)))
    assert not failed, "\n".join(map(str, failed[:10]))
