"""Plans per device (kernels/arch.py, kernels/budget.py): every architecture's limits are
respected by what the plans choose, an assumed architecture changes the plans and not the
results, and a device the kernels cannot serve computes with PyTorch and says so."""
import warnings

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import assert_matches_reference, forward_backward, kernels_launched, make_case, reference_forward_backward
from plan_fits import LOCAL_HEAD_DIMS, window_shapes
from timm_flashwin import window_attention
from timm_flashwin.kernels import arch, budget
from timm_flashwin.kernels.sizes import tile_side
from timm_flashwin.kernels.window import config
from timm_flashwin.kernels.local import plan as local_plan
from timm_flashwin.kernels.window import plan
from window_calls import window_call

FITTED = [a for a in arch.KNOWN.values() if not budget.keeps_tuned(a)]


@pytest.fixture(autouse=True)
def fresh_plans():
    plan.clear()
    arch._WARNED.clear()
    yield
    plan.clear()


def _clear_configurations() -> None:
    for cached in (config._default_forward_config, config._default_backward_config, config._fitted_forward,
                   config._fitted_backward, local_plan._default_plan, local_plan._fitted_plan):
        cached.cache_clear()


@pytest.fixture
def gpu_defaults(monkeypatch):
    """The configurations a GPU gets (the interpreter's tiles aside: ``config._streamed_block``,
    ``local_plan._default_plan``)."""
    monkeypatch.setattr(config, "INTERPRET", False)
    monkeypatch.setattr(local_plan, "INTERPRET", False)
    _clear_configurations()
    yield
    monkeypatch.undo()
    _clear_configurations()


def test_assumed_architecture(monkeypatch):
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_86")
    assert arch.device_arch(torch.device("cpu")) is arch.KNOWN["sm_86"]
    monkeypatch.setenv(arch.ASSUME_ENV, "89")
    assert arch.device_arch(torch.device("cpu")).shared_memory == 99 * 1024
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_61")
    with pytest.raises(ValueError, match="TIMM_FLASHWIN_ASSUME_ARCH='sm_61': expected one of sm_70, sm_75, sm_80"):
        arch.device_arch(torch.device("cpu"))
    monkeypatch.delenv(arch.ASSUME_ENV)
    assert arch.device_arch(torch.device("cpu")) is arch.INTERPRETER


def _window_plans(n, head_dim, cosine, dtype, target):
    for dropout in (False, True):
        for reads_mask in (False, True):
            yield "fwd", config.forward_config(n, head_dim, dtype, cosine, dropout, reads_mask, target), reads_mask
    bwd = config.backward_config(n, head_dim, dtype, cosine, target)
    if bwd is None or bwd.single_tile(n):
        yield "fused", bwd, False
    else:
        yield "dkdv", bwd, True
        yield "dq", bwd, True
        yield "dbias", config.dbias_config(n, head_dim, dtype, cosine, target), True


@pytest.mark.parametrize("target", FITTED, ids=lambda a: a.name)
def test_every_plan_fits_the_estimate_of_its_architecture(target, gpu_defaults):
    """For every model shape and build case, dtype, dropout and mask: the configuration the
    plans choose is estimated within the architecture's shared memory (tests/plan_fits.py
    checks the estimates against the compiler), or there is none and the op computes with
    PyTorch. On sm_86 and above every shape has one; the tuned configuration is kept where it
    fits."""
    for n, head_dim, cosine in window_shapes():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for kernel, tiles, reads_mask in _window_plans(n, head_dim, cosine, dtype, target):
                if tiles is None:
                    assert target.shared_memory < 99 * 1024, (n, head_dim, dtype, kernel)
                    continue
                need = budget.window_shared_bytes(kernel, tiles.block_m, tiles.block_n, tiles.block_d,
                                                  tiles.num_stages, dtype.itemsize,
                                                  n > tiles.block_n or kernel != "fwd" and kernel != "fused",
                                                  4 if reads_mask else 0)
                assert need <= target.shared_memory, (n, head_dim, dtype, kernel, tiles)
    for head_dim in LOCAL_HEAD_DIMS:
        for dtype in (torch.float32, torch.bfloat16):
            for kind in ("fwd", "dq", "dkdv"):
                for rows in (local_plan.SHORT, local_plan.LONG, local_plan.TALL):
                    tiles = local_plan.plan(kind, head_dim, dtype, rows, arch=target)
                    if not local_plan.fits(head_dim, dtype, target):
                        assert target.shared_memory < 99 * 1024 and dtype == torch.float32, (kind, head_dim)
                        continue
                    need = budget.local_shared_bytes(kind, tiles.block_m, tiles.block_n, tile_side(head_dim),
                                                     tiles.num_stages, dtype.itemsize)
                    assert need <= target.shared_memory, (kind, head_dim, dtype, rows, tiles)


def test_hopper_and_blackwell_keep_the_tuned_plans(gpu_defaults):
    for name in ("sm_90", "sm_100"):
        target = arch.KNOWN[name]
        for n, head_dim, cosine in window_shapes():
            for dtype in (torch.float32, torch.bfloat16):
                assert config.forward_config(n, head_dim, dtype, cosine, arch=target) == config.forward_config(
                    n, head_dim, dtype, cosine)
                assert config.backward_config(n, head_dim, dtype, cosine, target) == config.backward_config(
                    n, head_dim, dtype, cosine)
    # where it fits, a smaller GPU keeps the tuned configuration too (bf16 SwinV2 window 8)
    assert config.backward_config(64, 32, torch.bfloat16, True, arch.KNOWN["sm_86"]) == config.backward_config(
        64, 32, torch.bfloat16, True)


def test_smaller_gpus_take_fewer_stages_then_smaller_tiles(gpu_defaults):
    """float32 SwinV2 window 8 (N=64): the fused backward, 3 stages on an H100 (114 KB on
    sm_86's compiler), takes 2 on a 99 KB GPU; a T4's 64 KB cannot hold its tile at
    head_dim 64, so the backward streams key blocks there; head_dim 256 in float32 takes
    key blocks of 16 where an A100's 163 KB do not hold 32."""
    sm86, sm80, sm75 = (arch.KNOWN[name] for name in ("sm_86", "sm_80", "sm_75"))
    tuned = config.backward_config(64, 32, torch.float32, True)
    assert tuned.num_stages == 3 and config.backward_config(64, 32, torch.float32, True, sm86).num_stages == 2
    assert config.backward_config(64, 64, torch.float32, True, sm86).single_tile(64)
    assert not config.backward_config(64, 64, torch.float32, True, sm75).single_tile(64)
    call = window_call(64, 64, torch.float32, True, arch=sm75, windows=4, heads=2)
    assert not plan.call_plan(call).reads_table and plan.call_plan(call).stats_shape(call) == (4, 4, 2, 64)
    assert config.backward_config(49, 256, torch.float32, True, sm80).block_n < 32
    assert local_plan.plan("dq", 128, torch.bfloat16, arch=sm86) != local_plan.plan("dq", 128, torch.bfloat16)


def test_a_plan_fitted_to_another_road_computes_the_same(monkeypatch):
    """Assumed sm_75: float32 windows of 64 tokens at head_dim 64 take the multi-block
    backward (their one tile does not fit 64 KB), with the statistics the forward saves for
    it; forward and every gradient match float64 as on the tuned road."""
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_75")
    case = make_case(2, 1, 1, 64, 64, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    assert_matches_reference(results, reference_forward_backward(case), tol=2e-5)
    assert not plan.backward_plan(window_call(64, 64, torch.float32, True, arch=arch.KNOWN["sm_75"]), True,
                                  True).single_tile


def test_an_unserved_device_computes_with_pytorch_and_warns_once(monkeypatch):
    """A T4 (sm_75) has no bfloat16 tensor cores: bf16 calls compute with PyTorch (the
    reference math, as timm's), with one RuntimeWarning; float16 calls keep the kernels."""
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_75")
    case = make_case(2, 1, 1, 16, 16, cosine=False, masked=False, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    with kernels_launched() as launched:
        with pytest.warns(RuntimeWarning, match="sm_75 has no bfloat16 tensor cores.*computes with PyTorch"):
            out = window_attention(case.qkv, case.num_heads, **case.kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = window_attention(case.qkv, case.num_heads, **case.kwargs())
    assert not launched and torch.equal(out, again)
    assert arch.unserved_reason(arch.KNOWN["sm_75"], torch.float16) is None
    assert arch.unserved_reason(arch.KNOWN["sm_80"], torch.bfloat16) is None


def test_patch_model_on_an_unserved_device_keeps_timm_and_says_so(monkeypatch):
    """A bfloat16 model on an assumed T4 (sm_75): every module keeps timm's forward, with the
    reason in patch_report and one warning; strict=True raises it; float32 is patched."""
    from model_cases import tiny_swin
    from timm_flashwin import PatchError, patch_model, patch_report
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_75")
    model = tiny_swin().to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="sm_75 has no bfloat16 tensor cores: bfloat16 computes with PyTorch"):
        patch_model(model)
    report = patch_report(model)
    assert not report.patched and all("no bfloat16 tensor cores" in m.reason for m in report.modules)
    with pytest.raises(PatchError, match="no bfloat16 tensor cores"):
        patch_model(tiny_swin().to(torch.bfloat16), strict=True)
    assert len(patch_report(patch_model(tiny_swin())).patched) == len(report.modules)


def test_local_attention_on_an_unserved_dtype_computes_with_pytorch(monkeypatch):
    from timm_flashwin import sliding_window_attention
    monkeypatch.setenv(arch.ASSUME_ENV, "sm_70")
    monkeypatch.setattr("timm_flashwin.ops.local_operators.local_forward", lambda *a, **k: pytest.fail("launched"))
    q, k, v = (torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
               for i in range(3))
    with pytest.warns(RuntimeWarning, match="sm_70 has no bfloat16 tensor cores"):
        out = sliding_window_attention(q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), window=(4, 4))
    assert out.shape == q.shape and out.dtype == torch.bfloat16


def test_a_compiled_call_does_not_guard_on_the_device_cache(monkeypatch):
    """Under dynamo the device's limits are read, not looked up in ``arch._BY_DEVICE``: the
    plans, made outside dynamo while the same frame compiles, fill that cache, and a guard on
    it failed on the frame that made it (compiled SwinV2 on an H200). Here: the cache filled
    between two calls recompiles nothing."""
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setattr(arch, "_read", lambda index: arch.KNOWN["sm_90"])
    monkeypatch.setattr(arch, "_BY_DEVICE", {})
    counter = CompileCounter()
    scaled = torch.compile(lambda x: x * arch._arch_of(0).capability, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    assert scaled(torch.ones(2)).tolist() == [90.0, 90.0]
    assert arch._arch_of(0) is arch.KNOWN["sm_90"] and arch._BY_DEVICE == {0: arch.KNOWN["sm_90"]}
    scaled(torch.ones(2))
    assert counter.frame_count == 1
