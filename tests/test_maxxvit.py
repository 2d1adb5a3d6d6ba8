"""MaxViT, MaxxViT and CoAtNet (timm.models.maxxvit): the two adapters against timm's own
modules and models, float64 as the referee, and the patcher's promises for them.

timm is the oracle: its unpatched modules, with every parameter perturbed (verify.perturb_:
the bias tables N(0, 1), the rest moved off their initialization). Under the interpreter the
configurations are tiny (one 14x14 stage: four 7x7 block windows and a 7x7 grid strided by
2; CoAtNet's transformer stage on a 7x7 map); the GPU tests run the models as timm makes them.
"""
import copy
from functools import partial

import pytest
import timm
import torch
from timm.layers import RelPosBias, RelPosBiasTf, RelPosMlp
from torch import nn

from conftest import KERNEL_DEVICE
from model_checks import compiled_against_timm, every_model_patched, full_resolution_passes, judge, patched_in_place
from model_cases import flashwin_ops, images, maps_read_in_place, recording_backend
from timm_flashwin import PatchError, is_patched, patch_model, patch_report, unpatch_model
from timm_flashwin.tools.comparison import compare
from timm_flashwin.tools.verify import perturb_, verify_model

MAXXVIT = timm.models.maxxvit
ATTENTION = (MAXXVIT.AttentionCl, MAXXVIT.Attention2d)

#: one MaxViT stage on a 56x56 image (``SIZE``): a 14x14 map, 7x7 block windows and a 7x7 grid
ONE_STAGE = dict(depths=(1,), embed_dim=(32,), stem_width=(16, 32), transformer_partition_ratio=8, num_classes=10)
#: CoAtNet: a conv stage, then a transformer stage whose one window is its 7x7 map
COAT = dict(depths=(1, 1), embed_dim=(32, 64), stem_width=(16, 32), block_type=("C", "T"), num_classes=10)
SIZE = 56
#: id -> (timm model, overrides): every attention class, bias and qkv layout of the file
CONFIGS = {
    "rw": ("maxvit_tiny_rw_224", dict(ONE_STAGE, block_type=("M",))),  # AttentionCl, heads first, RelPosBias
    "tf": ("maxvit_tiny_tf_224", dict(ONE_STAGE, block_type=("M",))),  # (3, H, D) qkv, RelPosBiasTf
    "rmlp": ("maxvit_rmlp_tiny_rw_256", dict(ONE_STAGE, block_type=("M",))),  # RelPosMlp, its dropout
    "parallel": ("maxxvitv2_nano_rw_256", dict(ONE_STAGE, block_type=("PM",))),  # ParallelPartitionAttention
    "nchw": ("maxvit_tiny_rw_224", dict(ONE_STAGE, block_type=("M",), transformer_use_nchw_attn=True)),
    "coatnet": ("coatnet_0_rw_224", COAT),  # TransformerBlock2d: Attention2d on the whole map
    "coatnet_rmlp": ("coatnet_rmlp_1_rw_224", COAT),
}


def tiny(config: str, seed: int = 0, **kwargs) -> nn.Module:
    name, overrides = CONFIGS[config]
    torch.manual_seed(seed)
    return perturb_(timm.create_model(name, img_size=SIZE, drop_path_rate=0.0, **overrides, **kwargs), seed)


# ------------------------------------------------------------- against timm, float64 referee
@pytest.mark.parametrize("config", list(CONFIGS))
def test_patched_model_matches_timm(config):
    """A training step (float32, the kernels): every attention module's output, the model's
    and every parameter gradient against timm's, with verify's rule (at most twice as far
    from float64 as timm's own float32 arithmetic; gradients GRADIENT_FACTOR)."""
    name, overrides = CONFIGS[config]
    result = verify_model(name, img_size=SIZE, batch=1, train=True, model_kwargs=overrides)
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.patched_modules == len(result.layers) > 0
    assert any("rel_pos" in g.name for g in result.grads)  # the bias parameters' gradients were compared


def _module(cls, head_first: bool, rel_pos: str, dim: int = 64):
    """An attention module of ``cls`` (AttentionCl or Attention2d) with a 4x4 window."""
    window = (4, 4)
    rel_pos_cls = {"bias": RelPosBias, "tf": RelPosBiasTf, "none": None}.get(rel_pos)
    if rel_pos in ("mlp", "mlp_swin"):
        rel_pos_cls = partial(RelPosMlp, hidden_dim=32, mode="swin" if rel_pos == "mlp_swin" else "cr")
    rel_pos_cls = partial(rel_pos_cls, window_size=window) if rel_pos_cls else None
    torch.manual_seed(0)
    module = cls(dim, dim_head=16, head_first=head_first, rel_pos_cls=rel_pos_cls)
    return perturb_(module), window


MODULE_CASES = [(cls, head_first, rel_pos) for cls in ATTENTION for head_first in (True, False)
                for rel_pos in ("bias", "tf", "mlp", "mlp_swin", "none")]


@pytest.mark.parametrize("cls, head_first, rel_pos", MODULE_CASES,
                         ids=[f"{c.__name__}-{'heads_first' if h else 'qkv_first'}-{r}" for c, h, r in MODULE_CASES])
def test_module_matches_timm(cls, head_first, rel_pos):
    """Each class, qkv layout and bias (none: a ``shared_rel_pos`` given with the call, which
    gets its gradient too), in training mode (RelPosMlp's dropout drawn as timm's): output
    and every gradient against timm's module in float32 and float64."""
    module, (wh, ww) = _module(cls, head_first, rel_pos)
    shape = (6, wh, ww, 64) if cls is MAXXVIT.AttentionCl else (6, 64, wh, ww)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    shared = torch.randn(1, 4, wh * ww, wh * ww, generator=torch.Generator().manual_seed(2)) if rel_pos == "none" \
        else None
    ours = patch_model(copy.deepcopy(module), strict=True).to(KERNEL_DEVICE)
    results = []
    for net, dtype in ((ours, torch.float32), (module, torch.float32), (copy.deepcopy(module), torch.float64)):
        net = net.to(KERNEL_DEVICE, dtype).train()
        inputs = [t.detach().to(KERNEL_DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, shared)]
        torch.manual_seed(3)
        out = net(inputs[0], shared_rel_pos=inputs[1])
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out))
        results.append([out] + [t.grad for t in inputs if t is not None] + [p.grad for p in net.parameters()])
    assert is_patched(ours) and len(results[0]) == len(results[2]) > 3
    for i, (got, timm_out, ref) in enumerate(zip(*results)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        # verify's rule; RelPosMlp's output bias has a true gradient of 0 (softmax is shift
        # invariant), which compare reports as ill-conditioned instead of judging it
        comparison = compare(str(i), got, timm_out, ref, 1e-4, 1e-6)
        assert comparison.passed or comparison.ill_conditioned, comparison


# ----------------------------------------------------------------------- every model's modules
@pytest.mark.long
def test_every_registered_model_is_fully_patched_on_meta():
    """Every attention module of every maxxvit.py model (built on the meta device), strict,
    besides timm's tiny test models."""
    names = [name for name in timm.list_models(module="maxxvit") if not name.startswith("test_")]
    list(every_model_patched(names, ATTENTION, ("maxxvit", "maxxvit_2d")))


# ------------------------------------------------------------------------ behaviour
def test_partitions_are_read_from_the_map(monkeypatch):
    """MaxViT's block and grid windows ((3, H, D) qkv, the tf models) are read where they lie
    in the (B, H, W, C) map, no window_partition / grid_partition copies: the partitioned
    op's output bit for bit, and its gradients (the projections' weight gradients sum the
    tokens in another order); head-first qkv (the rw models) keeps timm's partition."""
    from timm_flashwin.ops.window_grid import WindowGrid
    grids = maps_read_in_place(monkeypatch)
    x = images(1, (SIZE, SIZE), device=KERNEL_DEVICE)
    results = []
    for feature_map in (True, False):
        model = patch_model(tiny("tf").to(KERNEL_DEVICE), feature_map=feature_map)
        out = model(x)
        out.square().sum().backward()
        results.append([out] + [p.grad for p in model.parameters()])
    # one 14x14 stage: 2x2 block windows of 7x7, then a 7x7 grid strided by 2
    assert grids == [WindowGrid(14, 14, (7, 7)), WindowGrid(14, 14, (7, 7), strided=True)]
    assert torch.equal(results[0][0], results[1][0])
    for on_map, partitioned in zip(*results):
        torch.testing.assert_close(on_map, partitioned, rtol=1e-5, atol=1e-7)
    grids.clear()
    patch_model(tiny("rw").to(KERNEL_DEVICE))(x)
    assert grids == []


def test_state_dict_unpatch_deepcopy_and_torch_save():
    model = tiny("rw").eval().to(KERNEL_DEVICE)
    x = images(1, (SIZE, SIZE), device=KERNEL_DEVICE)
    with patched_in_place(model, x, patched=2) as (expected, patched_out):
        assert "flashwin=maxxvit" in repr(model)
    assert not torch.equal(patched_out, expected)  # the kernels really ran while patched
    torch.testing.assert_close(patched_out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config, train", [("rw", False), ("tf", True), ("rmlp", True), ("coatnet", True)])
def test_compiles_without_graph_break(config, train):
    """torch.compile(fullgraph=True): one graph that calls the op once per module and holds no
    softmax nor SDPA of timm's, nor RelPosBiasTf's einsums (the op reads its table through
    the rows its lookups pick, constants of the graph); its output and gradients are as close to timm's float64 model
    as the eager patched model's are (verify's rule, the eager patched model the yardstick:
    cuDNN's float32 convolutions round differently in the graph and in eager mode, by 1e-3
    relative on a GPU; RelPosMlp's dropout drawn from the same seed on every side).
    Two images: with one, cuDNN gave the small maps' convolutions channels-last outputs whose
    strides the graph's fake tensors did not predict (H100, torch 2.11: inductor stops on it,
    "incorrect fake kernel" for aten.convolution; aot_eager runs on, and the op's kernels,
    traced with the fake strides, read a gradient laid out otherwise: CoAtNet's first-stage
    gradients 1.28 relative off)."""
    model = patch_model(tiny(config), strict=True).train(train).to(KERNEL_DEVICE)
    referee = tiny(config).double().train(train).to(KERNEL_DEVICE)  # timm's own model, float64
    x = images(2, (SIZE, SIZE), device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs, runs = [], []
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))
    for net, params, inputs in ((compiled, model, x), (model, model, x), (referee, referee, x.double())):
        params.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.set_grad_enabled(train):
            out = net(inputs)
            if train:
                out.square().sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in params.named_parameters() if p.grad is not None}))
    assert len(graphs) == 1 and flashwin_ops(graphs) == len(patch_report(model).patched)
    assert not any("softmax" in t or "scaled_dot_product" in t or "einsum" in t for t in graphs[0])
    # Attention2d's qkv is a matmul there (MaxxVit2dAdapter.flat_qkv): its convolutions are gone
    convolutions = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())  # timm's Conv2dSame too
    qkv_matmuls = sum(isinstance(m, MAXXVIT.Attention2d) for m in model.modules())
    assert sum("conv2d" in t for t in graphs[0]) == convolutions - qkv_matmuls
    compiled_run, eager_run, referee_run = runs
    if train:  # judge(ours, yardstick, float64, the yardstick's second run)
        failures = judge(compiled_run, eager_run, referee_run, eager_run)
    else:
        failures = [c for c in [compare("<output>", compiled_run[0], eager_run[0], referee_run[0], 1e-4, 1e-6)]
                    if not c.passed]
    assert not failures, failures


def test_tf_bias_under_export():
    """torch.export, whose graph may not read the lookups' values, takes ``get_bias()``
    (RelPosBiasTf's einsums stay in the graph); the exported program calls the op and gives
    timm's output."""
    plain, model = tiny("tf").eval(), patch_model(tiny("tf"), strict=True).eval()
    x = images(2, (SIZE, SIZE))
    program = torch.export.export(model, (x,))
    targets = [str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"]
    assert sum("timm_flashwin" in t for t in targets) == 2 and any("einsum" in t for t in targets)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), plain(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", ["tf", "rmlp"])
def test_calls_under_fake_tensor_mode_keep_nothing(config):
    """Calls under FakeTensorMode (shape inference, memory estimates), training and
    inference, compute what patched modules keep between eager calls (the index's (N, N)
    view, the TF lookups' rows, the grid's window maps, RelPosMlp's dropout ones, the
    inference bias) without keeping it: fake values kept there were read by the next eager
    calls (fake outputs, or a data-dependent error). Those calls then give timm's values, in
    float32 and in float64 (PyTorch's path, which reads the window maps)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    plain = tiny(config)
    model = patch_model(copy.deepcopy(plain), strict=True)
    x = images(1, (SIZE, SIZE))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = mode.from_tensor(x)
    for train in (True, False):
        with mode, torch.set_grad_enabled(train):
            assert model.train(train)(fake).shape == (1, 10)
    for dtype in (torch.float32, torch.float64):
        model, plain = model.to(dtype), plain.to(dtype)
        for train in (True, False):
            with torch.set_grad_enabled(train):
                torch.manual_seed(1)
                ours = model.train(train)(x.to(dtype))
                torch.manual_seed(1)
                expected = plain.train(train)(x.to(dtype))
            assert type(ours) is torch.Tensor
            torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_float64_and_plain_cpu_run_timms_math():
    """float64 (and any tensor the kernels do not take) computes in PyTorch: timm's values."""
    model = tiny("tf").double().eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(1, (SIZE, SIZE)).double()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-10, atol=1e-12)


def test_attention_dropout_runs_in_the_kernel(monkeypatch, deterministic_algorithms):
    """attn_drop > 0: applied by the kernels in training mode (p read at call time), not in
    eval mode; torch.manual_seed reproduces a training step, bit for bit in deterministic
    mode (on a GPU cuDNN's convolution backward and the op's multi-block backward otherwise
    add in any order: the steps' gradients differed in their last bits, H100)."""
    model = tiny("coatnet", transformer_attn_drop=0.25).to(KERNEL_DEVICE)
    timm_model = copy.deepcopy(model)
    patch_model(model, strict=True)
    import timm_flashwin.patching.adapters.base as base
    real, calls = base.window_attention, []
    monkeypatch.setattr(base, "window_attention", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    x = images(1, (SIZE, SIZE), device=KERNEL_DEVICE)
    with torch.no_grad():
        evaluated = model.eval()(x)
        torch.testing.assert_close(evaluated, timm_model.eval()(x), rtol=1e-4, atol=1e-5)
    steps = []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(5)
        out = model.train()(x)
        out.square().sum().backward()
        steps.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    assert calls == [0.0, 0.25, 0.25]
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert not torch.allclose(steps[0][0], evaluated, rtol=1e-3, atol=1e-3)


def test_reasons_in_the_report_and_strict_mode():
    """A rel_pos that is not timm's own class, a head_dim over 256: reported, strict raises."""
    class MyRelPos(MAXXVIT.RelPosBias):
        pass

    model = tiny("rw")
    block = model.stages[0].blocks[0]
    block.attn_grid.attn.rel_pos.__class__ = MyRelPos
    patch_model(model)
    reasons = {m.name: m.reason for m in patch_report(model).skipped}
    assert reasons == {"stages.0.blocks.0.attn_grid.attn": "rel_pos is a MyRelPos, not one of timm's RelPosBias, "
                                                           "RelPosBiasTf, RelPosMlp: its bias is not known"}
    with pytest.raises(PatchError, match="MyRelPos"):
        patch_model(unpatch_model(model), strict=True)
    wide = MAXXVIT.AttentionCl(288, dim_head=288)
    assert patch_report(patch_model(wide)).skipped[0].reason == "head_dim 288 is not in [1, 256]"


def test_bad_input_to_patched_modules():
    cl = patch_model(tiny("rw")).stages[0].blocks[0].attn_block.attn
    with pytest.raises(ValueError, match=r"expected 49 tokens per window \(its rel_pos is for 7x7\), got 48"):
        cl(torch.randn(2, 6, 8, 32))
    with pytest.raises(ValueError, match=r"expected x of shape \(B, \.\.\., C\) with C = 32"):
        cl(torch.randn(2, 7, 7, 16))
    two_d = patch_model(tiny("coatnet")).stages[1].blocks[0].attn
    with pytest.raises(ValueError, match=r"expected x of shape \(B, C, H, W\) with C = 32"):
        two_d(torch.randn(2, 49, 32))


def test_parameters_are_read_at_call_time():
    """In-place edits of a bias table between cached inference calls take effect."""
    model = tiny("tf").eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(1, (SIZE, SIZE))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-5)
        for net in (model, ours):
            net.stages[0].blocks[0].attn_block.attn.rel_pos.relative_position_bias_table.mul_(-2.0)
        torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(MAXXVIT.MaxxVit, "set_input_size"), reason="this timm cannot resize a MaxxVit")
@pytest.mark.parametrize("config", ["rw", "tf", "rmlp"])
def test_set_input_size(config):
    """New windows (set_input_size resizes the tables, indices and lookups) take effect."""
    model = tiny(config).eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x, y = images(1, (SIZE, SIZE)), images(1, (48, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-5)
        for net in (model, ours):
            net.set_input_size(img_size=(48, 48))  # windows 6x6
        assert {tuple(m.rel_pos.window_size) for m in ours.modules() if isinstance(m, ATTENTION)} == {(6, 6)}
        torch.testing.assert_close(ours(y), model(y), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ GPU only
GPU_MODELS = ["maxvit_tiny_rw_224", "maxvit_tiny_tf_224", "maxvit_tiny_tf_512", "maxvit_rmlp_nano_rw_256",
              "maxxvitv2_nano_rw_256", "coatnet_0_rw_224", "coatnet_rmlp_1_rw_224", "coatnet_rmlp_2_rw_384"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", GPU_MODELS)
def test_gpu_full_resolution_autocast(name, dtype):
    """Full resolution, AMP, forward and every gradient: windows of 49 to 576 tokens (the
    kernels that stream key blocks from 144 on)."""
    full_resolution_passes(name, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("name, overrides", [
    ("maxvit_tiny_rw_224", {}), ("maxvit_rmlp_nano_rw_256", {}), ("coatnet_0_rw_224", {}),
    ("maxvit_tiny_tf_224", dict(depths=(1, 1, 1, 1))),  # RelPosBiasTf's rows constants of the graph
])
def test_gpu_torch_compile_inference_and_training(name, overrides):
    """torch.compile(fullgraph=True, inductor) of the patched model, float32: the eval output
    and a training step's gradients against timm's (model_checks.compiled_against_timm)."""
    torch._inductor.config.fallback_random = True  # RelPosMlp's dropout: eager's random numbers
    torch.manual_seed(0)
    failed = compiled_against_timm(perturb_(timm.create_model(name, drop_path_rate=0.0, **overrides)))
    assert not failed, "\n".join(map(str, failed[:10]))
