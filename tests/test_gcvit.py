"""GCViT (timm.models.gcvit): its adapter against timm's own modules and models, float64 as
the referee, and the patcher's promises for it.

timm is the oracle: its unpatched modules, every parameter perturbed (verify.perturb_: the
bias tables N(0, 1)). Two images or more everywhere: with one, every order of the global
queries over the windows is the same. Under the interpreter the configurations are tiny
(two stages of a local and a global block, 7x7 windows: four windows an image, then one);
the GPU tests run the models as timm makes them.
"""
import copy
import inspect
from typing import Optional

import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from model_checks import (compiled_against_timm, every_model_patched, full_resolution_passes, judge, patched_in_place,
                          training_step_runs)
from model_cases import flashwin_ops, images, recording_backend
from opcases import relative_error
from timm_flashwin import PatchError, is_patched, patch_model, patch_report, unpatch_model
from timm_flashwin.patching.adapters import gcvit as adapter
from timm_flashwin.tools.comparison import compare
from timm_flashwin.tools.verify import perturb_

GCVIT = timm.models.gcvit
ATTENTION = GCVIT.WindowAttentionGlobal
#: a 56x56 image: stage maps 14x14 (four 7x7 windows, the global query pooled once) and 7x7
TINY = dict(img_size=56, depths=(2, 2), num_heads=(1, 2), embed_dim=16, window_size=(7, 7), num_classes=10)


def tiny_model(seed: int = 0, **kwargs) -> nn.Module:
    """GCViT's factory fixes depths and heads: a small one from its class, perturbed."""
    torch.manual_seed(seed)
    return perturb_(GCVIT.GlobalContextVit(**dict(TINY, **kwargs)), seed)


def test_patched_model_matches_timm():
    """A training step (float32, the kernels), two images: the output and every parameter
    gradient against timm's, with verify's rule."""
    model = tiny_model().train().to(KERNEL_DEVICE)
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(2, (56, 56), device=KERNEL_DEVICE)
    runs = training_step_runs(model, ours, x)
    assert len(patch_report(ours).patched) == 4 and len(runs[2][1]) == len(list(model.parameters()))
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))


# ------------------------------------------------------------------------- modules
def module_case(use_global: bool, **kwargs) -> nn.Module:
    """A perturbed WindowAttentionGlobal: 32 channels, 2 heads, a non-square 3x4 window."""
    torch.manual_seed(0)
    return perturb_(ATTENTION(32, 2, (3, 4), use_global=use_global, **kwargs))


def some_inputs(images_in: int = 2, windows: int = 3):
    """x (B * nW, 12, 32) and q_global (B, 3, 4, 32)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(images_in * windows, 12, 32, generator=gen), torch.randn(images_in, 3, 4, 32, generator=gen)


def tiled_forward(self, x: torch.Tensor, q_global: Optional[torch.Tensor] = None) -> torch.Tensor:
    """timm 1.0.29's WindowAttentionGlobal.forward: q_global tiled over the windows
    (``repeat``), window b taking image b % B's query."""
    B, N, C = x.shape
    if self.use_global and q_global is not None:
        kv = self.qkv(x)
        kv = kv.reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        q = q_global.repeat(B // q_global.shape[0], 1, 1, 1)
        q = q.reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
    else:
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
    attn = self.rel_pos((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    return self.proj_drop(self.proj((self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, N, C)))


@pytest.mark.parametrize("use_global, recompute_qkv, order", [
    (False, False, "installed"), (True, False, "installed"), (True, True, "installed"), (True, False, "timm 1.0.29")])
def test_module_matches_timm(use_global, recompute_qkv, order, monkeypatch):
    """Local and global blocks in training mode, with recompute_qkv, and under timm 1.0.29's
    order of the global queries (its forward in place of the installed one): output and every
    gradient (x, q_global, parameters) against timm's module in float32 and float64."""
    if order != "installed":
        monkeypatch.setattr(ATTENTION, "forward", tiled_forward)
        assert adapter.query_order() == adapter.TILED
    module = module_case(use_global)
    ours = patch_model(copy.deepcopy(module), strict=True, recompute_qkv=recompute_qkv)
    results = []
    for net, dtype in ((ours, torch.float32), (module, torch.float32), (copy.deepcopy(module), torch.float64)):
        net = net.to(KERNEL_DEVICE, dtype).train()
        inputs = [t.to(KERNEL_DEVICE, dtype).requires_grad_() for t in some_inputs()]
        out = net(*inputs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out))
        results.append([out] + [t.grad for t in inputs if t.grad is not None] + [p.grad for p in net.parameters()])
    assert is_patched(ours) and len(results[0]) == len(results[2]) == 7 + use_global
    for i, (got, timm_out, ref) in enumerate(zip(*results)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        comparison = compare(str(i), got, timm_out, ref, 1e-4, 1e-6)
        assert comparison.passed, comparison


def test_an_unknown_order_is_reported(monkeypatch):
    """A timm whose forward repeats q_global neither way: its global blocks keep timm's
    forward, with the reason; strict raises; the local blocks are patched."""
    monkeypatch.setattr(ATTENTION, "forward", lambda self, x, q_global=None: x)
    model = nn.Sequential(module_case(False), module_case(True))
    patch_model(model)
    assert [m.name for m in patch_report(model).patched] == ["0"]
    assert [m.reason for m in patch_report(model).skipped] == [
        f"timm {timm.__version__}: WindowAttentionGlobal's forward repeats q_global neither with repeat_interleave "
        "nor with repeat: which image's query each window takes is not known"]
    with pytest.raises(PatchError, match="neither with repeat_interleave"):
        patch_model(unpatch_model(model), strict=True)


# ----------------------------------------------------------------------- every model's modules
def test_every_registered_model_is_fully_patched_on_meta():
    """Every attention module of every gcvit model (built on the meta device), strict: each
    model's local and global ones."""
    for name, model in every_model_patched(timm.list_models(module="gcvit"), ATTENTION, ("gcvit",)):
        assert {m.use_global for m in model.modules() if isinstance(m, ATTENTION)} == {False, True}, name


def test_list_shows_family_and_windows():
    """``timm-flashwin list`` (discovery.supported_models): the third stage's 14x14 windows."""
    from timm_flashwin.tools.discovery import supported_models
    rows = {i.name: i for i in supported_models("gcvit*")}
    assert set(rows) == {"gcvit_xxtiny", "gcvit_xtiny", "gcvit_tiny", "gcvit_small", "gcvit_base"}
    assert all(i.families == ["gcvit"] and i.stage_windows == [(7, 7), (7, 7), (14, 14), (7, 7)] for i in rows.values())
    assert (rows["gcvit_xxtiny"].modules, rows["gcvit_tiny"].modules) == (12, 31)


# ------------------------------------------------------------------------ behaviour
class Pair(nn.Module):
    """A local and a global module on the same windows and queries."""

    def __init__(self, **kwargs):
        super().__init__()
        self.parts = nn.ModuleList([module_case(False, **kwargs), module_case(True, **kwargs)])

    def forward(self, x: torch.Tensor, q_global: torch.Tensor) -> torch.Tensor:
        """x (B * nW, 12, 32), q_global (B, 3, 4, 32) -> (B * nW, 12, 64)."""
        return torch.cat([part(x, q_global) for part in self.parts], -1)


def test_state_dict_unpatch_deepcopy_script_and_torch_save():
    model = tiny_model().eval().to(KERNEL_DEVICE)
    x = images(2, (56, 56), device=KERNEL_DEVICE)
    with patched_in_place(model, x, patched=4) as (expected, patched_out):
        module = model.stages[0].blocks[1].attn
        assert "flashwin=gcvit" in repr(module)
        assert list(inspect.signature(type(module).forward).parameters) == ["self", "x", "q_global"]
        gen = torch.Generator().manual_seed(2)  # two images of four 7x7 windows, 16 channels
        windows, q_global = (torch.randn(shape, generator=gen).to(KERNEL_DEVICE) for shape in ((8, 49, 16),
                                                                                            (2, 7, 7, 16)))
        # TorchScript compiles timm's forward (the patched class's forward, timm's signature)
        torch.testing.assert_close(torch.jit.script(module)(windows, q_global),
                                   module._flashwin_timm_forward(windows, q_global), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(module(x=windows, q_global=q_global), module._flashwin_timm_forward(windows, q_global),
                                   rtol=1e-4, atol=1e-5)
    assert not torch.equal(patched_out, expected)  # the kernels really ran while patched
    torch.testing.assert_close(patched_out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("train", [False, True])
def test_compiles_without_graph_break(train):
    """torch.compile(fullgraph=True): one graph that calls the op once per module and holds
    no softmax of timm's; its output and gradients are the eager patched model's."""
    model = patch_model(Pair(), strict=True).train(train).to(KERNEL_DEVICE)
    x, q_global = (t.to(KERNEL_DEVICE).requires_grad_(train) for t in some_inputs())
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        x.grad = q_global.grad = None
        with torch.set_grad_enabled(train):
            out = net(x, q_global)
            if train:
                out.square().sum().backward()
        results.append([out.detach()] + ([x.grad, q_global.grad] + [p.grad for p in model.parameters()]
                                          if train else []))
    assert len(graphs) == 1 and flashwin_ops(graphs) == 2
    assert not any("softmax" in t for t in graphs[0])
    for compiled, eager in zip(*results):
        assert relative_error(compiled, eager) < 1e-5


def test_float64_and_plain_cpu_run_timms_math():
    """float64 (and any tensor the kernels do not take) computes in PyTorch: timm's values."""
    model = tiny_model().double().eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(2, (56, 56)).double()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-10, atol=1e-12)


def test_attention_dropout_runs_in_the_kernel(monkeypatch):
    """attn_drop > 0: applied by the kernels in training mode (p read at call time), not in
    eval mode; torch.manual_seed reproduces a step."""
    model = Pair(attn_drop=0.25).to(KERNEL_DEVICE)
    timm_model = copy.deepcopy(model)
    patch_model(model, strict=True)
    real, calls = adapter.window_attention, []
    monkeypatch.setattr(adapter, "window_attention", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    inputs = [t.to(KERNEL_DEVICE) for t in some_inputs()]
    with torch.no_grad():
        evaluated = model.eval()(*inputs)
        torch.testing.assert_close(evaluated, timm_model.eval()(*inputs), rtol=1e-4, atol=1e-5)
    steps = []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(5)
        out = model.train()(*inputs)
        out.square().sum().backward()
        steps.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    assert calls == [0.0, 0.0] + [0.25] * 4
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert not torch.allclose(steps[0][0], evaluated, rtol=1e-3, atol=1e-3)


def test_bad_input_to_patched_modules():
    local, global_ = patch_model(Pair()).parts
    x, q_global = some_inputs()
    with pytest.raises(ValueError, match=r"expected N = 3\*4 = 12 tokens per window, got 11"):
        local(x[:, :11], q_global)
    with pytest.raises(ValueError, match=r"expected q_global of shape \(B, Wh, Ww, C\) with Wh\*Ww = 12 tokens"):
        global_(x, q_global[:, :2])
    with pytest.raises(ValueError, match=r"B dividing the 6 windows, got \(4, 3, 4, 32\)"):
        global_(x, torch.cat([q_global, q_global]))
    with pytest.raises(RuntimeError):  # timm's own error: its kv linear read as q, k and v
        global_(x)
    torch.testing.assert_close(local(x, None), local._flashwin_timm_forward(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["gcvit_xxtiny", "gcvit_tiny", "gcvit_base"])
def test_gpu_full_resolution_autocast(name, dtype):
    """Full resolution, AMP, forward and every gradient: 7x7 and 14x14 windows, the global
    queries of four images over 64, 16, 1 windows (stage 3: 4 windows of 14x14)."""
    full_resolution_passes(name, dtype, batch=4, kept=0)


@pytest.mark.cuda
def test_gpu_torch_compile_inference_and_training():
    """torch.compile(fullgraph=True, inductor) of the patched model, float32: the eval output
    and a training step's gradients against timm's (model_checks.compiled_against_timm)."""
    torch.manual_seed(0)
    failed = compiled_against_timm(perturb_(timm.create_model("gcvit_xxtiny", drop_path_rate=0.0)))
    assert not failed, "\n".join(map(str, failed[:10]))


def _peak_above_start(fn) -> int:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.cuda
def test_gpu_compiled_global_attention_holds_one_qkv():
    """Compiled inference of a global block's patched module holds no more memory than its
    eager call: the queries, keys and values side by side (a view of a concatenation) are
    computed once for the op, not once per unused pointer they stood in for (six copies at
    GCViT-tiny's first stage, ``launcher.unused_pointer``). bf16, 512 windows of 49 tokens."""
    module = patch_model(ATTENTION(64, 2, (7, 7), use_global=True)).cuda().eval().to(torch.bfloat16)
    x = torch.randn(512, 49, 64, device="cuda", dtype=torch.bfloat16)
    q_global = torch.randn(8, 7, 7, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    with torch.inference_mode():
        compiled(x, q_global)
        eager_peak = _peak_above_start(lambda: module(x, q_global))
        compiled_peak = _peak_above_start(lambda: compiled(x, q_global))
        torch.testing.assert_close(compiled(x, q_global), module(x, q_global), rtol=2e-2, atol=2e-2)
    # eager: kv (2 C), qkv (3 C), out (C) and the projection's output (C) per token at most;
    # six more copies of the qkv made the compiled peak over 3x the eager one
    assert compiled_peak <= 1.5 * eager_peak, (compiled_peak, eager_peak)
