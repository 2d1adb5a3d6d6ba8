"""How the op reads the shift mask and the bias: the mask's region structure (kept on the
mask until it changes), which mask build each launch takes, the float16 bias copy the
streaming kernels read (and the mask folded into it), each against the float64 reference."""

from dataclasses import replace

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import (TOLERANCE, assert_matches_reference, bias_as_read, forward_backward, make_case,
                     reference_forward_backward, relative_error, shift_mask)
from timm_flashwin.ops import host_program
from timm_flashwin import window_attention
from timm_flashwin.kernels.window.bias_mask import mask_structure
from timm_flashwin.ops.reference import window_attention_reference


def test_mask_structure_recognizes_region_masks_only():
    """The multi-block kernels compute M from region ids only where M is exactly
    value * [region_i != region_j]; any other mask keeps being read densely."""
    shift = shift_mask(3, 16, torch.Generator().manual_seed(0))
    regions, info = mask_structure(shift)
    assert info.tolist() == [1.0, -100.0, 0.0, 1.0, 0.0]  # [exact, value, then window 1 alone one region]
    assert torch.equal(torch.where(regions[:, :, None] == regions[:, None, :], 0.0, -100.0), shift)
    assert mask_structure(torch.where(shift == 0, 0.0, float("-inf")))[1].tolist() == [1.0, float("-inf"), 0, 1, 0]
    assert mask_structure(torch.zeros(2, 9, 9))[1].tolist() == [1.0, 0.0, 1.0, 1.0]
    two_values = shift.clone()
    two_values[0, 0, shift[0, 0] != 0] = -50.0
    nan = shift.clone()
    nan[2, 3, 4] = float("nan")
    no_zero_row = shift.clone()
    no_zero_row[1, 2] = -100.0
    for other in (torch.randn(3, 16, 16), two_values, nan, no_zero_row, -shift.abs() - 1):
        assert mask_structure(other)[1][0] == 0


def test_mask_structure_is_kept_on_the_mask_until_it_changes(monkeypatch):
    """Eager calls with the same mask tensor find its region structure once; an in-place
    change of the mask (here: no longer region-structured) is seen by the next call, whose
    output follows the new mask (multi-block path, N = 144)."""
    from timm_flashwin.kernels.window import bias_mask
    found = []
    monkeypatch.setattr(bias_mask, "mask_structure", lambda m: (found.append(1), mask_structure(m))[1])
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    first = window_attention(case.qkv, 3, **case.kwargs())
    assert torch.equal(window_attention(case.qkv, 3, **case.kwargs()), first) and len(found) == 1
    with torch.no_grad():
        case.mask[1, :, :5] -= 7.0
    changed = window_attention(case.qkv, 3, **case.kwargs())
    assert len(found) == 2
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(changed, expected) < TOLERANCE[torch.float32]


def test_mask_structure_kept_under_inference_mode_serves_training():
    """A model called under torch.inference_mode first, then trained: the mask's region
    structure kept by the inference call is a normal tensor, which the training call's
    forward can save for its backward (an inference tensor cannot be saved)."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    with torch.inference_mode():
        window_attention(case.qkv, 3, **case.kwargs())
    qkv = case.qkv.detach().requires_grad_()
    window_attention(qkv, 3, **case.kwargs()).sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def _record_launches(monkeypatch, flags=("FROM_REGIONS",)) -> list:
    """(kernel name, *the values of ``flags``) of every kernel launch from here on, recorded
    where the attention kernels' host side launches them (``launcher`` as launch.py and
    bias_mask.py call it): the GPU's direct launches, which skip ``wrap_triton``, as well
    as the interpreter's and traced ones. Host programs are switched off: a replayed call
    launches from its recording, never through ``launcher``."""
    from timm_flashwin.kernels.window import bias_mask, launch
    from timm_flashwin.kernels import launcher as launcher_module
    monkeypatch.setattr(host_program, "ENABLED", False)
    launches, real_launcher = [], launcher_module.launcher

    def recording(kernel):
        launcher = real_launcher(kernel)

        class Recorded:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launches.append((kernel.__name__, *(kwargs.get(flag) for flag in flags)))
                    return launcher[grid](*args, **kwargs)
                return run
        return Recorded()

    for module in (launch, bias_mask):
        monkeypatch.setattr(module, "launcher", recording)
    return launches


def test_eager_launches_ask_for_fma_contraction(monkeypatch):
    """Every kernel of an eager forward + backward, the float16 bias copy included, is
    launched with ``enable_fp_fusion=True`` (``launcher.compiler_options``): the kernels were
    measured and their precision stated with multiply-adds contracted, which Triton stops
    doing by default from 3.10."""
    case = make_case(4, 2, 3, 144, 16, cosine=True, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    launches = _record_launches(monkeypatch, ("enable_fp_fusion",))
    forward_backward(window_attention, case)
    kernels = {name for name, _ in launches}
    assert {"float16_bias_copy_kernel", "window_attention_fwd_kernel", "window_attention_bwd_delta_kernel",
            "window_attention_bwd_dkdv_kernel"} <= kernels, kernels
    assert all(fusion is True for _, fusion in launches), launches


@pytest.mark.parametrize("structured", [True, False], ids=["timm-mask", "dense-mask"])
def test_eager_calls_launch_only_the_build_of_the_masks_kind(structured, monkeypatch):
    """The kernels that stream key blocks are built once per kind of mask. The first eager
    call with a mask launches both builds (its kind is on the device only: a mask built
    anew in every call costs no synchronization); from the second call with the same mask
    on, whose kind was then read once on the host, only the build of that kind runs
    (forward and dkdv kernel). Results match the reference either way."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    if not structured:
        case.mask = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    launches = _record_launches(monkeypatch)
    for call in range(2):
        launches.clear()
        results = forward_backward(window_attention, case)
        streaming = [(name, kind) for name, kind in launches if kind is not None]
        kinds = (True, False) if call == 0 else (structured,)
        assert streaming == ([("window_attention_fwd_kernel", kind) for kind in kinds]
                             + [("window_attention_bwd_dkdv_kernel", kind) for kind in kinds])
        assert_matches_reference(results, reference_forward_backward(case), 1e-4)


def test_inference_tensor_masks_launch_both_builds(monkeypatch):
    """A mask made under torch.inference_mode keeps no structure (no version counter):
    its kind stays on the device, both builds are launched, the other one's programs
    return at once, and the output is the reference's."""
    case = make_case(4, 2, 3, 144, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    launches = _record_launches(monkeypatch)
    with torch.inference_mode():
        mask = case.mask.clone()
        out = window_attention(case.qkv, 3, **case.kwargs(mask=mask))
    assert launches == [("window_attention_fwd_kernel", True), ("window_attention_fwd_kernel", False)]
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_inference_tensors_are_not_kept_on(dtype, monkeypatch):
    """Bias and mask made under torch.inference_mode (a mask timm computes in the forward,
    a bias gathered there) have no version counter: what is derived from them (float32:
    the mask's region structure, a contiguous bias; 16-bit inputs: the float16 copy of
    bias + mask) is computed in every call, not kept. Host programs are switched off: a
    replayed call recomputes what its recording did, without the functions counted here."""
    from timm_flashwin.kernels.window import bias_mask
    monkeypatch.setattr(host_program, "ENABLED", False)
    found = []
    monkeypatch.setattr(bias_mask, "mask_structure", lambda m: (found.append(1), mask_structure(m))[1])
    copies = []
    real_copy = bias_mask._log2e_float16_copy
    monkeypatch.setattr(bias_mask, "_log2e_float16_copy", lambda *a: (copies.append(1), real_copy(*a))[1])
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=dtype, device=KERNEL_DEVICE)
    with torch.inference_mode():
        bias, mask = case.bias.clone(), case.mask.clone()
        outs = [window_attention(case.qkv, 3, bias=bias, mask=mask, scale=case.scale) for _ in range(2)]
    assert (len(found), len(copies)) == ((2, 0) if dtype == torch.float32 else (0, 2))
    assert torch.equal(outs[0], outs[1])
    assert "_flashwin_streamed_bias" not in bias.__dict__ and "_flashwin_mask_structure" not in mask.__dict__
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(outs[0], expected) < TOLERANCE[dtype]


def _record_bias_reads(monkeypatch):
    """The (dtype, contiguous) of every bias the launchers hand to a kernel."""
    from timm_flashwin.kernels.window import launch
    seen = []
    real = launch.bias_mask_args
    monkeypatch.setattr(launch, "bias_mask_args", lambda bias, *rest: (
        seen.append((bias.dtype, bias.is_contiguous())), real(bias, *rest))[1])
    return seen


@pytest.mark.parametrize("n", [49, 144])
def test_transposed_bias_reaches_streaming_kernels_contiguous(n, monkeypatch, deterministic_algorithms):
    """SwinV2-CR's bias is a transposed view (column stride H). Kernels that stream key
    blocks (N = 144) get it copied into rows, one copy for both passes; one-tile windows
    (N = 49) read it as it is. Either way, the same output and bias gradient as with a
    contiguous bias, to the last bits only: on a GPU the kernel built for strided bias
    reads is not the unit-stride one (6 of 7203 bias-gradient values of ~1e-23, near
    fp32's denormals, differed in their last bits, H200). In deterministic mode: the
    multi-block backward's atomic adds round in the order they land (on an H100 the bias
    gradients of two calls then differed beyond rtol 1e-5)."""
    case = make_case(4, 2, 3, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    transposed = case.bias.permute(1, 2, 0).contiguous().permute(2, 0, 1).detach().requires_grad_()
    assert not transposed.is_contiguous()
    seen = _record_bias_reads(monkeypatch)
    out = window_attention(case.qkv, 3, **dict(case.kwargs(), bias=transposed))
    out.backward(case.grad_out)
    assert seen == [(torch.float32, n == 144)] * 2
    expected_bias = case.bias.detach().clone().requires_grad_()
    expected = window_attention(case.qkv, 3, **dict(case.kwargs(), bias=expected_bias))
    expected.backward(case.grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(transposed.grad, expected_bias.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [49, 144])
def test_streaming_kernels_read_a_float16_bias(dtype, n, monkeypatch):
    """With 16-bit inputs the kernels that stream key blocks (N = 144) read a float16 copy
    of a float32 bias, made once for both passes; one-tile windows read the float32 bias.
    The gradient is the float32 bias's, within the dtype's tolerance of float64."""
    case = make_case(4, 2, 3, n, 32, cosine=False, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=3)
    assert case.bias.dtype == torch.float32
    seen = _record_bias_reads(monkeypatch)
    results = forward_backward(window_attention, case)
    assert seen == [(torch.float16 if n == 144 else torch.float32, True)] * 2
    assert results[2].dtype == torch.float32
    exact_bias = forward_backward(window_attention_reference, case, torch.float64)  # not bias_as_read
    assert_matches_reference(results, exact_bias, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_float16_bias_copy_moves_the_logit_scale_gradient_as_its_rounding_does(dtype):
    """Cosine attention streaming key blocks with 16-bit inputs reads a float16 copy of the
    bias. Against the exact bias, the output and the qkv and bias gradients stay within the
    dtype's tolerance; the logit-scale gradient, a sum whose terms cancel, moves by as much
    as the rounding of the bias moves it in float64 (a few 1e-2 where it is small), and
    against the rounded bias (the other tests' reference) it is within tolerance."""
    case = make_case(4, 2, 2, 144, 16, cosine=True, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=144)
    results = forward_backward(window_attention, case)
    exact = forward_backward(window_attention_reference, case, torch.float64)
    rounded = reference_forward_backward(case)
    assert not torch.equal(rounded[2], exact[2])  # the rounded bias is what the reference took
    assert_matches_reference(results[:3], exact[:3], TOLERANCE[dtype])
    assert_matches_reference(results, rounded, TOLERANCE[dtype])
    rounding_effect = (rounded[3] - exact[3]).abs()
    assert ((results[3] - exact[3]).abs() <= 1.5 * rounding_effect + TOLERANCE[dtype] * exact[3].abs()).all()


def test_one_bias_serves_float32_and_16bit_inputs_in_turn():
    """The copy of the bias that the streaming kernels read is kept on the bias tensor: a
    contiguous copy for float32 inputs, a float16 copy times log2(e) for 16-bit ones. The
    same (non-contiguous) bias used with float32, then float16, then float32 inputs again
    gets the copy each needs, and each output matches the reference."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    bias = case.bias.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    for dtype in (torch.float32, torch.float16, torch.float32):
        qkv = case.qkv.to(dtype)
        out = window_attention(qkv, 3, bias=bias, mask=case.mask, scale=case.scale)
        rounded = bias_as_read(replace(case, qkv=qkv, bias=bias)).bias
        expected = window_attention_reference(qkv.double(), 3, bias=rounded.double(), mask=case.mask.double(),
                                              scale=case.scale)
        assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy cast
def test_bias_beyond_float16_range_gives_nan_rows():
    """A float32 bias value beyond float16's range (65504), with bf16 inputs on the
    streaming kernels, turns its row into NaN rather than into a silently different row;
    -inf in the bias still masks, and float32 inputs read the bias as it is."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=False, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    bias = case.bias.detach().clone()
    bias[1, 7, 3] = 1e5
    bias[0, 2, :100] = float("-inf")
    out = window_attention(case.qkv, 3, bias=bias, scale=case.scale)
    nan_rows = out.isnan().any(-1)
    assert nan_rows[:, 7].all() and nan_rows.sum() == 4  # query 7 of every window; head 1's columns only
    assert out[..., 16:32].isnan().any() and not out[..., :16].isnan().any()
    reference = window_attention_reference(case.qkv.double(), 3, bias=bias.double(), scale=case.scale)
    torch.testing.assert_close(out[:, :, :16].double(), reference[:, :, :16], rtol=2e-2, atol=2e-2)
    out32 = window_attention(case.qkv.float(), 3, bias=bias, scale=case.scale)
    assert not out32.isnan().any()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy cast
def test_float16_copy_folds_the_mask_into_the_bias():
    """The copy the streaming kernels read with 16-bit inputs: (bias[h] + mask[w]) * log2(e)
    per (window, head), rounded to float16; a finite sum beyond float16's range is NaN where
    positive and float16's lowest where negative (a mask of -1e9); +-inf and NaN stay."""
    from timm_flashwin.kernels.window.bias_mask import _log2e_float16_copy
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(3, 9, 9, generator=g).permute(0, 2, 1).to(KERNEL_DEVICE)  # strided, as SwinV2-CR's
    mask = torch.where(torch.rand(2, 9, 9, generator=g) < 0.3, -100.0, 0.0).to(KERNEL_DEVICE)
    bias[1, 2, 3], mask[0, 4, 5], mask[1, 0, 1], mask[1, 6, 7] = 1e5, -1e9, float("-inf"), float("nan")
    log2e = 1.4426950408889634

    def expected(exact):
        rounded = exact.half()
        beyond = exact.isfinite() & rounded.isinf()
        rounded[beyond & (exact > 0)] = float("nan")
        rounded[beyond & (exact < 0)] = -65504.0
        return rounded.float()

    copy = _log2e_float16_copy(bias, mask)
    assert copy.shape == (2, 3, 9, 9) and copy.dtype == torch.float16 and copy.is_contiguous()
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(copy.float(), expected((bias[None] + mask[:, None]).float() * log2e), **same)
    assert copy[0, 1, 2, 3].isnan() and copy[0, :, 4, 5].eq(-65504).all() and copy[1, :, 0, 1].eq(float("-inf")).all()
    assert copy[1, :, 6, 7].isnan().all()
    torch.testing.assert_close(_log2e_float16_copy(None, mask)[:, 0].float(), expected(mask.float() * log2e), **same)
    torch.testing.assert_close(_log2e_float16_copy(bias, None)[0].float(), expected(bias.float() * log2e), **same)


def test_masks_fold_into_the_bias_copy_where_it_is_small():
    """16-bit inputs fold the mask into the streaming kernels' float16 bias copy where that
    (nW, H, N, N) copy is at most config.FOLDED_MASK_MAX_BYTES: window 16 of the benchmarks
    (16 mask windows, 3 heads, 256 tokens: 6.3 MB) does, window 24 (16, 4, 576: 42.5 MB)
    reads the mask's region ids; float32 inputs always do."""
    from timm_flashwin.kernels.window.bias_mask import folds_mask
    from window_calls import window_call

    def folds(dtype, heads, periods, n):
        return folds_mask(window_call(n, 32, dtype, False, heads=heads, periods=periods))
    assert folds(torch.bfloat16, 3, 16, 256) and folds(torch.float16, 4, 16, 144)
    assert not folds(torch.bfloat16, 4, 16, 576) and not folds(torch.float32, 3, 16, 256)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_16bit_streaming_kernels_read_the_mask_folded_into_the_bias(cosine, with_bias, monkeypatch):
    """With 16-bit inputs the kernels that stream key blocks (N = 144) read the mask folded
    into their float16 bias copy: launched without a mask of their own, and without region
    ids, whatever the mask (here a dense one, not region-structured, with -1e9 entries, a
    fully masked row and a partly masked one). Forward and every gradient as the float64
    reference's; the fully masked row NaN as there."""
    case = make_case(4, 2, 3, 144, 16, cosine=cosine, masked=True, dtype=torch.float16, device=KERNEL_DEVICE,
                     seed=21, with_bias=with_bias)
    mask = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    mask[0, 3, ::2] = -1e9
    mask[1, 5, :] = float("-inf")
    case.mask = mask
    launches = _record_launches(monkeypatch, ("HAS_MASK", "MASK_REGIONS"))
    results = forward_backward(window_attention, case)
    streaming = [name for name, has_mask, regions in launches if regions is not None]
    assert streaming == ["window_attention_fwd_kernel", "window_attention_bwd_dkdv_kernel"] + (
        ["window_attention_bwd_dbias_kernel"] if with_bias and not cosine else [])
    assert all(has_mask is False and not regions for _, has_mask, regions in launches if regions is not None)
    reference = reference_forward_backward(case)
    nan_rows = results[0].isnan().any(-1)
    assert nan_rows[1::2, 5].all() and nan_rows.sum() == 2  # query 5 of the windows b of mask window 1
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
    case.mask = torch.where(mask.isinf(), 0.0, mask)  # no NaN row: every value compared
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float16])
