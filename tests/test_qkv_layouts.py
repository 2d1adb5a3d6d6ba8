"""qkv layouts other than timm's Swin qkv linear, read in place through the kernels' strides.

MaxViT's attention (``head_first=True``) lays each token's channels out as (H, 3, D), heads
outermost, and CoAtNet's ``Attention2d`` holds qkv channels-first, (B, 3*H*D, N), the
output of a 1x1 convolution. ``window_attention`` takes both as views (a 5-D
(B_, N, 3, H, D) one, or a transposed 3-D one), without a copy: its output and every
gradient must be those of the same values in the Swin layout, and qkv's gradient must come
in qkv's own layout (a view of a contiguous tensor, as autograd passes it on).
"""
import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from opcases import (TOLERANCE, assert_matches_reference, forward_backward, make_case, reference_forward_backward,
                     relative_error)
from timm_flashwin import window_attention


def heads_interleaved(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """The same values as (B_, N, 3, H, D) view of a tensor whose channels are (H, 3, D)."""
    windows, n, channels = qkv.shape
    physical = qkv.view(windows, n, 3, heads, -1).transpose(2, 3).contiguous()  # (B_, N, H, 3, D)
    return physical.transpose(2, 3)


def channels_first(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """The same values as a (B_, N, 3*H*D) view of a (B_, 3*H*D, N) tensor."""
    return qkv.transpose(1, 2).contiguous().transpose(1, 2)


def channels_first_interleaved(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Both: a (B_, N, 3, H, D) view of a (B_, H, 3, D, N) tensor (Attention2d, head_first)."""
    windows, n, channels = qkv.shape
    physical = qkv.view(windows, n, 3, heads, -1).permute(0, 3, 2, 4, 1).contiguous()  # (B_, H, 3, D, N)
    return physical.permute(0, 4, 2, 1, 3)


LAYOUTS = {"heads_interleaved": heads_interleaved, "channels_first": channels_first,
           "channels_first_interleaved": channels_first_interleaved}


def _run(case, layout, dtype=None):
    """forward_backward of the op on qkv in ``layout``, and the gradient the op gives that
    layout's view (not as a leaf's .grad, which autograd may copy)."""
    def fn(qkv, heads, **kwargs):
        view = LAYOUTS[layout](qkv, heads)
        out = window_attention(view, heads, **kwargs)
        fn.view_grad = torch.autograd.grad(out, view, case.grad_out.to(out.dtype), retain_graph=True)[0]
        return out
    results = forward_backward(fn, case, dtype)
    return results, fn.view_grad


# every layout through the one-tile kernels; the multi-block ones (forward, delta, dkdv, dq
# or dq_finish, dbias) read and write every stride the same way, with both strides changed
CASES = [(n, layout) for layout in LAYOUTS for n in (49,)] + [(72, "channels_first_interleaved")]


@pytest.mark.parametrize("n, layout", CASES, ids=[f"{n}-{layout}" for n, layout in CASES])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_layouts_match_the_reference_and_the_swin_layout(cosine, n, layout):
    """Output and every gradient: as the float64 reference gives them, and what the kernels
    give on the same values in the Swin layout (the same arithmetic at other addresses: bit
    for bit under the interpreter; on a GPU the compiler may lay a tile out otherwise for
    other strides, and sum a row's products in another order); qkv's gradient in qkv's
    layout."""
    case = make_case(4, 2, 3 if n <= 64 else 2, n, 32 if n <= 64 else 16, cosine=cosine, masked=True,
                     dtype=torch.float32, device=KERNEL_DEVICE, seed=n)
    got, view_grad = _run(case, layout)
    view = LAYOUTS[layout](case.qkv, case.num_heads)
    assert not view.is_contiguous()
    assert view_grad.stride() == view.stride()
    swin = forward_backward(window_attention, case)
    for a, b in zip(got, swin):
        assert torch.equal(a, b) if not HAS_CUDA else relative_error(a, b) < 1e-5
    assert_matches_reference(got, reference_forward_backward(case), TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_heads_interleaved_16bit_matches_the_reference(dtype):
    case = make_case(4, 1, 2, 64, 32, cosine=False, masked=False, dtype=dtype, device=KERNEL_DEVICE, seed=7)
    got, _ = _run(case, "channels_first_interleaved")
    assert_matches_reference(got, reference_forward_backward(case), TOLERANCE[dtype])


def test_layouts_through_the_registered_operator(monkeypatch):
    """The operator (torch.compile's road) and its fake implementation take the 5-D view:
    the same values, the fake's qkv gradient in the real one's layout."""
    from timm_flashwin.ops import window as op
    case = make_case(2, 1, 2, 16, 16, cosine=True, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    eager, _ = _run(case, "channels_first_interleaved")
    monkeypatch.setattr(op, "dispatch_free", lambda tensor: False)
    dispatched, view_grad = _run(case, "channels_first_interleaved")
    for a, b in zip(eager, dispatched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    qkv = channels_first_interleaved(case.qkv, 2)
    assert view_grad.stride() == qkv.stride()
    logit_scale = case.logit_scale.reshape(2)
    from timm_flashwin.ops.window_operators import _backward_fake
    fake_grad = _backward_fake(case.grad_out, qkv, None, None, None, None, None, None, logit_scale, 2, 1.0,
                               True, False, True, 0.0, None)[0]
    assert fake_grad.shape == qkv.shape and fake_grad.stride() == qkv.stride()


def test_compiles_without_graph_break():
    case = make_case(2, 1, 2, 16, 16, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    compiled = torch.compile(lambda qkv, heads, **kw: window_attention(heads_interleaved(qkv, heads), heads, **kw),
                             fullgraph=True, backend="aot_eager")
    assert_matches_reference(forward_backward(compiled, case), reference_forward_backward(case), 1e-4)


@pytest.mark.parametrize("shape, heads, match", [
    ((2, 16, 2, 2, 8), 2, r"\(B_, N, 3, H, D\) with H = num_heads = 2"),
    ((2, 16, 3, 4, 8), 2, r"\(B_, N, 3, H, D\) with H = num_heads = 2"),
    ((2, 16, 3, 2, 8, 1), 2, "a 3-D tensor .* or a 5-D one"),
])
def test_bad_5d_shapes_say_what_was_expected(shape, heads, match):
    with pytest.raises(ValueError, match=match):
        window_attention(torch.zeros(shape, device=KERNEL_DEVICE), heads, scale=1.0)
