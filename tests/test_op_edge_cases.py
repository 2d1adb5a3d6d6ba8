"""The op at its edges: the logit scale at and beyond its clamp, fully masked rows, NaN
inputs and NaN logit scales propagating as in timm's math; bad input named by argument."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, KERNEL_DEVICE
from opcases import assert_matches_reference, forward_backward, make_case, reference_forward_backward
from timm_flashwin import window_attention
from timm_flashwin.ops.window_checks import MAX_TOKENS
from timm_flashwin.kernels.window.bias_mask import mask_structure
from timm_flashwin.kernels.window.tiles import head_scale
from timm_flashwin.ops.reference import LOGIT_SCALE_MAX, window_attention_reference


def test_logit_scale_gradient_stops_at_the_clamp():
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.tensor([1.0, LOGIT_SCALE_MAX - 1e-3, LOGIT_SCALE_MAX + 0.5], device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    d_logit = results[3]
    assert d_logit[0] != 0 and d_logit[1] != 0
    assert d_logit[2] == 0  # clamped: no gradient, as torch.clamp gives
    assert_matches_reference(results, reference_forward_backward(case), 1e-4)


def test_logit_scale_at_the_bound_follows_torch_clamp():
    """At exactly float32(ln 100) the gradient is whatever timm's own float32
    torch.clamp gives on this device."""
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.full((3,), LOGIT_SCALE_MAX, device=KERNEL_DEVICE)
    d_logit = forward_backward(window_attention, case)[3]
    ls = case.logit_scale.clone().requires_grad_()
    torch.clamp(ls, max=LOGIT_SCALE_MAX).exp().sum().backward()
    assert torch.equal(d_logit != 0, ls.grad != 0)


@pytest.mark.parametrize("n", [16, 144], ids=["one-tile", "multi-block"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_fully_masked_row_is_nan_like_the_reference(cosine, n):
    """Also the dense-mask fallback of the multi-block kernels: this mask is not
    region-structured."""
    case = make_case(4, 2, 3, n, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    mask = case.mask.clone()
    mask[1, 5, :] = float("-inf")  # window 1, query 5: nothing to attend to
    mask[0, 3, ::2] = float("-inf")  # partly masked: still finite
    assert mask_structure(mask)[1][0] == 0
    case.mask = mask
    results = forward_backward(window_attention, case)
    reference = reference_forward_backward(case)
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
        scale = max(1.0, ref.nan_to_num(0.0).abs().max().item())  # cancelling sums keep their terms' rounding
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
    assert results[0][1::2, 5].isnan().all() and not results[0][0::2].isnan().any()


def test_nan_input_propagates_like_the_reference():
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    case.qkv = case.qkv.clone()
    case.qkv[2, 7, 0] = float("nan")  # a query element of head 0 in window 2
    out = window_attention(case.qkv, 3, **case.kwargs())
    ref = window_attention_reference(case.qkv.double(), 3, **case.kwargs())
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()


@triton.jit
def head_scales_kernel(logit_scale_ptr, out_ptr):
    """out[h] = the head scale the kernels compute from logit_scale[h]."""
    h = tl.program_id(0)
    tl.store(out_ptr + h, head_scale(logit_scale_ptr, h, 1.0, True))


def test_head_scale_is_exp_of_the_clamped_logit_scale_within_half_an_ulp():
    """The kernels compute s = exp(min(logit_scale, ln 100)) themselves (tiles.head_scale),
    one value that multiplies every logit (up to 100): within half a float32 ulp of the
    exact value, as precise as torch's own float32 exp or better (float32 tl.exp is 3 to
    5 ulp off, enough to move float32 SwinV2 gradients past timm's own error)."""
    logit_scale = torch.cat([torch.linspace(-3.0, 5.0, 253), torch.tensor([LOGIT_SCALE_MAX, 4.6051702, 1e-3])])
    logit_scale = logit_scale.to(KERNEL_DEVICE)
    out = torch.empty_like(logit_scale)
    head_scales_kernel[(logit_scale.numel(),)](logit_scale, out)
    exact = torch.clamp(logit_scale, max=LOGIT_SCALE_MAX).double().exp()  # clamped in float32, as torch.clamp does
    ulp = torch.finfo(torch.float32).eps * exact.float().abs().double()  # spacing above 2^k, 2 ulp below
    assert ((out.double() - exact).abs() <= 0.5 * ulp).all()


@pytest.mark.parametrize("n", [16, 144], ids=["one-tile", "multi-block"])
def test_nan_logit_scale_propagates_like_torch_clamp(n):
    """The kernels clamp and exponentiate the logit scale themselves: a NaN one gives its
    head NaN outputs and gradients, the other heads stay finite, and its own gradient is
    0 (torch.clamp's backward compares, and NaN <= ln 100 is false), as in the reference."""
    case = make_case(4, 2, 3, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.tensor([1.0, float("nan"), 2.0], device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    reference = reference_forward_backward(case)
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
    assert results[0][..., 16:32].isnan().all() and not results[0][..., :16].isnan().any()
    assert results[3][1] == 0 and results[3][[0, 2]].isfinite().all()
    finite = [torch.nan_to_num(t) for t in results]
    assert_matches_reference(finite, [torch.nan_to_num(t) for t in reference], 1e-4)


def test_infinite_logit_scale_computes_as_timm():
    """One rule for the scales: a Python float ``scale`` must be finite (a ValueError, as the
    local operators' ``scale``: test_bad_input_names_the_argument); a tensor ``logit_scale``
    is a parameter whose values are not read to the host (a synchronization at every call),
    and the kernels clamp and exponentiate it as timm does: +inf gives its head a scale of
    100 (the clamp at ln 100), -inf a scale of 0 (uniform attention), both finite, as in
    the reference (NaN: test_nan_logit_scale_propagates_like_torch_clamp)."""
    import math
    from timm_flashwin.ops import local
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.tensor([math.inf, -math.inf, 2.0], device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    assert all(t.isfinite().all() for t in results[:3])
    assert_matches_reference(results, reference_forward_backward(case), 1e-4)
    q = torch.randn(1, 1, 8, 4)
    for scale in (math.nan, math.inf):
        with pytest.raises(ValueError, match=f"sliding_window_attention: `scale` must be finite, got {scale}"):
            local.sliding_window_attention(q, q, q, causal=True, scale=scale)
        with pytest.raises(ValueError, match=f"window_attention: `scale` must be finite, got {scale}"):
            _call(_ok(scale=scale))


# ----------------------------------------------------------------------------- bad input
def _ok(**override):
    case = make_case(4, 2, 2, 9, 8, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    args = dict(qkv=case.qkv, num_heads=2, bias=case.bias, mask=case.mask, scale=case.scale, logit_scale=None)
    args.update(override)
    return args


def z(*shape, dtype=torch.float32, device=KERNEL_DEVICE):
    """Zeros on the kernel device, so that each bad input fails the check it names."""
    return torch.zeros(*shape, dtype=dtype, device=device)


def _call(args):
    args = dict(args)
    return window_attention(args.pop("qkv"), args.pop("num_heads"), **args)


BAD_INPUTS = [
    ("qkv", TypeError, lambda: _ok(qkv=[[1.0]])),
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9))),
    ("qkv", TypeError, lambda: _ok(qkv=z(4, 9, 48, dtype=torch.int32))),
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 50))),  # not divisible by 3 * H
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 0))),  # head_dim 0
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 3 * 2 * 264))),  # head_dim 264 > 256
    ("qkv", ValueError, lambda: _ok(qkv=z(1, MAX_TOKENS + 1, 48), bias=None, mask=None)),  # N too large
    ("num_heads", ValueError, lambda: _ok(num_heads=0)),
    ("num_heads", ValueError, lambda: _ok(num_heads=2.0)),
    ("bias", ValueError, lambda: _ok(bias=z(2, 9, 8))),
    ("bias", ValueError, lambda: _ok(bias=z(3, 9, 9))),
    ("bias", ValueError, lambda: _ok(bias=z(2, 2, 9, 9))),
    ("bias", TypeError, lambda: _ok(bias=z(2, 9, 9, dtype=torch.float64))),
    ("bias", TypeError, lambda: _ok(bias="table")),
    ("mask", ValueError, lambda: _ok(mask=z(3, 9, 9))),  # 3 does not divide B_ = 4
    ("mask", ValueError, lambda: _ok(mask=z(2, 9, 8))),
    ("mask", ValueError, lambda: _ok(mask=z(2, 1, 9, 9))),
    ("mask", TypeError, lambda: _ok(mask=z(2, 9, 9, dtype=torch.bool))),
    ("scale", TypeError, lambda: _ok(scale="0.1")),
    ("scale", TypeError, lambda: _ok(scale=None)),  # neither scale nor logit_scale
    ("scale", ValueError, lambda: _ok(scale=float("nan"))),  # not finite: as the local operators
    ("scale", ValueError, lambda: _ok(scale=float("inf"))),
    ("scale", ValueError, lambda: _ok(scale=-float("inf"))),
    ("logit_scale", TypeError, lambda: _ok(logit_scale=z(2))),  # both given
    ("logit_scale", ValueError, lambda: _ok(scale=None, logit_scale=z(3))),
    ("logit_scale", ValueError, lambda: _ok(scale=None, logit_scale=z(2, 2))),
    ("dropout_p", ValueError, lambda: _ok(dropout_p=1.0)),
    ("dropout_p", ValueError, lambda: _ok(dropout_p=-0.1)),
    ("dropout_p", ValueError, lambda: _ok(dropout_p="0.1")),
]
if HAS_CUDA:
    BAD_INPUTS.append(("bias", ValueError, lambda: _ok(bias=z(2, 9, 9, device="cpu"))))
else:
    BAD_INPUTS.append(("bias", ValueError, lambda: _ok(bias=z(2, 9, 9, device="meta"))))


@pytest.mark.parametrize("argument,error,make_args", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _, _) in
                                                                      enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(argument, error, make_args):
    with pytest.raises(error, match=f"`{argument}`"):
        _call(make_args())


def test_bad_input_message_says_expected_and_got():
    with pytest.raises(ValueError) as info:
        _call(_ok(mask=z(3, 9, 9)))
    assert "nW dividing B_ = 4" in str(info.value) and "nW = 3" in str(info.value)
