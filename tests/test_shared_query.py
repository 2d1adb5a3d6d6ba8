"""``window_attention(kv, ..., query=)``: queries shared by the windows of an image (GCViT's
global query), read by the kernels from their own tensor. Against the float64 reference
of the same math (``reference.shared_query_qkv``: timm's repeat and concatenation): the
output and every gradient, on each backward path (one tile, multi-block with the dq
kernel or dQ by atomic adds, the dbias kernel), both query orders, V1 and cosine, the
bias dense and as a table; and the argument checks.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter on CPU tensors (conftest.py).
"""
import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import TOLERANCE, relative_error
from timm_flashwin import window_attention
from timm_flashwin.kernels.window import config
from timm_flashwin.ops.position_bias import TableBias
from timm_flashwin.ops.reference import shared_query_qkv, window_attention_reference

HEADS, HEAD_DIM = 2, 16


def case(images: int, windows: int, n: int, cosine: bool, dtype: torch.dtype, seed: int = 0):
    """kv (B_, N, 2*H*D), query (B, N, H*D), bias (H, N, N), logit_scale (H,): leaves."""
    g = torch.Generator().manual_seed(seed)
    channels = HEADS * HEAD_DIM
    kv = torch.randn(images * windows, n, 2 * channels, generator=g)
    query = torch.randn(images, n, channels, generator=g)
    bias = torch.randn(HEADS, n, n, generator=g)
    logit_scale = torch.log(torch.tensor([10.0, 30.0])) if cosine else None
    leaves = [t.to(KERNEL_DEVICE, dtype if t is not bias and t is not logit_scale else torch.float32)
              if t is not None else None for t in (kv, query, bias, logit_scale)]
    return [t.requires_grad_() if t is not None else None for t in leaves]


def run(kv, query, bias, logit_scale, order, *, table=False):
    """The op's output and the gradients of kv, query, bias (or its table), logit_scale for a
    fixed random output gradient."""
    scale = None if logit_scale is not None else HEAD_DIM ** -0.5
    if table:
        n = kv.shape[1]
        index = torch.arange(n * n, device=kv.device).view(n, n) % 7
        table_t = bias[:, 0, :7].t().detach().clone().requires_grad_()  # (7, H)
        out = window_attention(kv, HEADS, bias=TableBias(table_t, index), scale=scale, logit_scale=logit_scale,
                               query=query, query_order=order)
        bias = table_t
    else:
        out = window_attention(kv, HEADS, bias=bias, scale=scale, logit_scale=logit_scale, query=query,
                               query_order=order)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    leaves = [t for t in (kv, query, bias, logit_scale) if t is not None]
    return [out, *torch.autograd.grad(out, leaves, grad)]


def reference(kv, query, bias, logit_scale, order, *, table=False):
    """``run``'s values in float64 by PyTorch: the queries repeated and concatenated, as timm does."""
    d = [t.detach().double().cpu().requires_grad_() if t is not None else None for t in (kv, query, bias, logit_scale)]
    kv64, query64, bias64, scale64 = d
    if table:
        n = kv.shape[1]
        index = torch.arange(n * n).view(n, n) % 7
        bias64 = bias64[:, 0, :7].t().detach().clone().requires_grad_()
        dense = bias64[index.view(-1)].view(n, n, HEADS).permute(2, 0, 1)
    else:
        dense = bias64
    qkv = shared_query_qkv(kv64.unflatten(2, (2, HEADS, HEAD_DIM)), query64, order == "tiled")
    out = window_attention_reference(qkv, HEADS, bias=dense, scale=None if scale64 is not None else HEAD_DIM ** -0.5,
                                     logit_scale=scale64)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(kv.dtype).double()
    leaves = [t for t in (kv64, query64, bias64, scale64) if t is not None]
    return [out, *torch.autograd.grad(out, leaves, grad)]


def check(results, expected, tol):
    names = ("out", "d_kv", "d_query", "d_bias", "d_logit_scale")
    for name, got, want in zip(names, results, expected):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = relative_error(got.cpu(), want)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("order", ["image_major", "tiled"])
@pytest.mark.parametrize("n", [12, 144], ids=["one_tile", "multi_block"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_matches_reference(cosine, n, order):
    inputs = case(2, 3, n, cosine, torch.float32)
    check(run(*inputs, order), reference(*inputs, order), TOLERANCE[torch.float32])


@pytest.mark.parametrize("dq_atomic", [True, False], ids=["dq-atomic-adds", "dq-kernel"])
def test_multi_block_dq_paths(dq_atomic, monkeypatch):
    """The dq kernel and dq_finish read the shared queries too; the dbias kernel (no slots)."""
    key = ("bwd", 144, HEAD_DIM, torch.bfloat16, True)
    tiles = config.with_changes(config.backward_config(*key[1:]), dq_atomic=dq_atomic, dbias_slots=0)
    monkeypatch.setitem(config.OVERRIDES, key, tiles)
    inputs = case(3, 2, 144, True, torch.bfloat16, seed=2)
    check(run(*inputs, "tiled"), reference(*inputs, "tiled"), TOLERANCE[torch.bfloat16])


def test_bias_table_read_by_the_kernels():
    inputs = case(2, 2, 16, False, torch.bfloat16, seed=3)
    check(run(*inputs, "image_major", table=True), reference(*inputs, "image_major", table=True),
          TOLERANCE[torch.bfloat16])


def test_one_image_and_orders_agree():
    """With one image both orders are the same computation."""
    inputs = case(1, 4, 12, False, torch.float32, seed=4)
    a, b = run(*inputs, "image_major"), run(*inputs, "tiled")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_query_without_grad_and_kv_layout():
    """A query that takes no gradient, and a query whose channels are not contiguous (copied
    to kv's channel stride): the same output."""
    kv, query, bias, _ = case(2, 2, 12, False, torch.float32, seed=5)
    query = query.detach()
    out = window_attention(kv, HEADS, bias=bias, scale=0.25, query=query)
    strided = query.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(window_attention(kv, HEADS, bias=bias, scale=0.25, query=strided), out)
    (kv_grad,) = torch.autograd.grad(out.sum(), [kv])
    assert kv_grad.shape == kv.shape


@pytest.mark.parametrize("bad, message", [
    (dict(query=torch.zeros(2, 12, 31)), "`query` must be of shape"),
    (dict(query=torch.zeros(5, 12, 32)), "`query` must be of shape"),
    (dict(query=torch.zeros(2, 12, 32, dtype=torch.float64)), "`query` must be of qkv's dtype"),
    (dict(query="q"), "`query` must be a torch.Tensor"),
    (dict(query_order="rows"), "`query_order` must be"),
    (dict(kv=torch.zeros(4, 12, 98)), "divisible by 2 * num_heads"),
])
def test_bad_arguments_are_named(bad, message):
    kv = bad.pop("kv", torch.zeros(4, 12, 64))
    query = bad.pop("query", torch.zeros(2, 12, 32))
    with pytest.raises((TypeError, ValueError), match=message.replace("*", r"\*")):
        window_attention(kv.to(KERNEL_DEVICE), HEADS, scale=0.25,
                         query=query.to(KERNEL_DEVICE) if isinstance(query, torch.Tensor) else query, **bad)
