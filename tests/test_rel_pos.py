"""decomposed_attention and rel_pos_terms (ops/rel_pos.py): the local kernels with a decomposed
relative-position bias (kernels/local/bias.py) against the float64 reference, output and the
gradients of q, k, v and both bias terms; both layouts of the bias (key tiles of one grid row,
16 columns under the interpreter's 16-wide tiles; one-hot, any other width), fewer or more
queries than keys, grouped heads, head_dim 80, dropout with the kernels' own mask, the
registered operators, bad input. The GPU-only cases (SAM's shapes, every dtype) are the
``cuda`` ones at the end."""
from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import TOLERANCE, assert_matches_reference
from timm_flashwin import decomposed_attention, rel_pos_terms
from timm_flashwin.kernels.local import launch as local_launch
from timm_flashwin.kernels.local.bias import DECOMPOSED
from timm_flashwin.ops.local_operators import local_attention_bwd, local_attention_fwd
from timm_flashwin.ops.local_reference import local_attention_reference, sliding_window_visible

NAMES = ("out", "dq", "dk", "dv", "d_rel_h", "d_rel_w")
SEES_ALL = sliding_window_visible(None, None)


def make_inputs(B, H, H_kv, queries, key_size, D, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    """q (B, H, S_q, D), k, v (B, H_kv, key_h * key_w, D), rel_h, rel_w and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    S_k = key_size[0] * key_size[1]
    q, do = (torch.randn(B, H, queries, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H_kv, S_k, D, generator=g) for _ in range(2))
    rel_h, rel_w = (torch.randn(B, H, queries, side, generator=g) for side in key_size)
    return [t.to(dtype).to(device) for t in (q, k, v, rel_h, rel_w, do)]


def dense_bias(rel_h, rel_w, key_size):
    """The bias as (rows, keys) -> (B, H, rows, keys) blocks, from the terms (``local_reference``)."""
    return lambda rows, cols: rel_h[:, :, rows][..., cols // key_size[1]] + rel_w[:, :, rows][..., cols % key_size[1]]


def forward_backward(fn, tensors, do, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def reference(q, k, v, rel_h, rel_w, do, key_size, scale=None, dropout_factor=None):
    def fn(q, k, v, rel_h, rel_w):
        return local_attention_reference(q, k, v, SEES_ALL, scale, dropout_factor=dropout_factor,
                                         bias=dense_bias(rel_h, rel_w, key_size))
    return forward_backward(fn, (q, k, v, rel_h, rel_w), do, torch.float64)


CASES = [  # (B, H, H_kv, queries, key grid, D)
    pytest.param(1, 2, 2, 64, (4, 16), 16, id="row-tiles"),
    pytest.param(2, 2, 1, 35, (5, 7), 16, id="one-hot-gqa"),
    pytest.param(1, 1, 1, 9, (6, 6), 24, id="fewer-queries"),
    pytest.param(1, 2, 2, 50, (3, 4), 80, id="more-queries-d80"),
]


@pytest.mark.parametrize("B, H, H_kv, queries, key_size, D", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(B, H, H_kv, queries, key_size, D, dtype):
    if dtype != torch.float32 and D != 16:
        pytest.skip("one shape per 16-bit dtype")
    q, k, v, rel_h, rel_w, do = make_inputs(B, H, H_kv, queries, key_size, D, dtype)
    ours = forward_backward(lambda *t: decomposed_attention(*t, key_size=key_size), (q, k, v, rel_h, rel_w), do)
    assert_matches_reference(ours, reference(q, k, v, rel_h, rel_w, do, key_size), TOLERANCE[dtype], names=NAMES)


def test_terms_of_a_model_and_scale():
    """rel_pos_terms from q's strided views of a qkv projection and gathered tables, through
    the op with a non-default scale: every gradient, the tables' and qkv's, matches float64."""
    g = torch.Generator().manual_seed(3)
    B, H, D, size = 2, 2, 16, (3, 5)
    qkv0, table_h0, table_w0 = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
                                ((B, 15, 3 * H * D), (3, 3, D), (5, 5, D)))
    do = torch.randn(B, H, 15, D, generator=g, dtype=torch.float64)
    runs = []
    for dtype, device in ((torch.float32, KERNEL_DEVICE), (torch.float64, "cpu")):
        qkv, table_h, table_w = (t.to(device, dtype).requires_grad_() for t in (qkv0, table_h0, table_w0))
        q, k, v = (t.transpose(1, 2) for t in qkv.view(B, 15, 3, H, D).unbind(2))
        rel_h, rel_w = rel_pos_terms(q, table_h, table_w, size)
        out = decomposed_attention(q, k, v, rel_h, rel_w, key_size=size, scale=0.3)
        out.backward(do.to(device, dtype))
        runs.append([out.detach(), qkv.grad, table_h.grad, table_w.grad])
    assert_matches_reference(runs[0], runs[1], TOLERANCE[torch.float32], names=("out", "dqkv", "d_table_h", "d_table_w"))


@pytest.mark.parametrize("size, rows, always", [((3, 5), (5, 9), False), ((4, 4), (9, 3), False),
                                                ((2, 6), (3, 11), True)])
def test_table_terms_are_the_gathered_tables_terms(size, rows, always):
    """rel_pos_table_terms (one product with the model's tables, gathered per query) against
    rel_pos_terms of SAM's gathered tables (an einsum per grid row): tables of the grid's
    rows, interpolated ones (fewer and more rows) and transformers' interpolation every call;
    the values and the gradients of q and both tables, float64."""
    from timm_flashwin import rel_pos_table_terms
    from timm_flashwin.ops.rel_pos import gathered_table
    g = torch.Generator().manual_seed(rows[0])
    q0 = torch.randn(2, 3, size[0] * size[1], 8, generator=g, dtype=torch.float64)
    tables0 = [torch.randn(r, 8, generator=g, dtype=torch.float64) for r in rows]
    grads = [torch.randn(2, 3, size[0] * size[1], side, generator=g, dtype=torch.float64) for side in size]
    results = []
    for gathered in (True, False):
        q, table_h, table_w = (t.clone().requires_grad_() for t in [q0] + tables0)
        if gathered:
            terms = rel_pos_terms(q, gathered_table(table_h, size[0], size[0], always),
                                  gathered_table(table_w, size[1], size[1], always), size)
        else:
            terms = rel_pos_table_terms(q.transpose(2, 3).contiguous().transpose(2, 3), table_h, table_w, size,
                                        always)
        torch.autograd.backward(terms, grads)
        results.append([*terms, q.grad, table_h.grad, table_w.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim, dtype", [(80, torch.float32), (64, torch.bfloat16)], ids=["d80-float32", "d64-bf16"])
def test_kernels_with_an_h200s_plans_touch_only_their_tensors(monkeypatch, head_dim, dtype):
    """SAM's 14 x 14 windows with the tiles, warps and bias layout the kernels take on an
    H200 (sm_90), forward and backward under the interpreter: every load and store within
    its tensors (tests/bounds.py). (The float32 head_dim 80 case's illegal memory access on
    an H200 was not in this addressing but in triton 3.6's build of the dq kernel's 64-row
    plan, which read shared memory out of bounds: ``local.plan._PLANS_32BIT``.)"""
    from bounds import views_checked
    from timm_flashwin.kernels.arch import KNOWN
    from timm_flashwin.kernels.local import plan as local_plan
    call = local_plan.LocalCall(1, 2, 2, 196, 196, head_dim, dtype, KNOWN["sm_90"], (1, -1, -1, 0), False, True,
                                DECOMPOSED, 14, 14)
    with monkeypatch.context() as patch:  # the GPU's plans, as an H200 makes them
        patch.setattr(local_plan, "INTERPRET", False)
        local_plan._fitted_plan.cache_clear()
        gpu_plan = local_plan._call_plan(call, False)
    local_plan._fitted_plan.cache_clear()
    local_plan.clear()
    for kind in ("fwd", "dq", "dkdv"):
        for rows in (local_plan.SHORT, local_plan.LONG, local_plan.TALL):
            monkeypatch.setitem(local_plan.OVERRIDES, (kind, head_dim, dtype, rows), getattr(gpu_plan, kind).tiles)
    q, k, v, rel_h, rel_w, do = make_inputs(1, 2, 2, 196, (14, 14), head_dim, dtype)
    with views_checked() as outside:
        ours = forward_backward(lambda *t: decomposed_attention(*t, key_size=(14, 14)), (q, k, v, rel_h, rel_w), do)
    assert all(local_plan.plan(kind, head_dim, dtype) == getattr(gpu_plan, kind).tiles != (16, 16, 4, 1)
               for kind in ("fwd", "dq", "dkdv"))  # the H200's tiles ran, not the interpreter's
    assert gpu_plan.dkdv.kwargs["ROW_TILE"] is False and outside == {}
    assert_matches_reference(ours, reference(q, k, v, rel_h, rel_w, do, (14, 14)), TOLERANCE[dtype], names=NAMES)


def test_dropout_takes_the_kernels_mask():
    """With dropout, the kernels' own mask (regenerated from the seed the op drew): output
    and gradients as the reference's with that mask."""
    q, k, v, rel_h, rel_w, do = make_inputs(1, 2, 2, 40, (4, 8), 16)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    ours = forward_backward(lambda *t: decomposed_attention(*t, key_size=(4, 8), dropout_p=0.3),
                            (q, k, v, rel_h, rel_w), do)
    torch.set_rng_state(state)
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).to(KERNEL_DEVICE)
    factor = local_launch.dropout_factors(seed, 1, 2, 40, 0.3, keys=32)
    assert_matches_reference(ours, reference(q, k, v, rel_h, rel_w, do, (4, 8), dropout_factor=factor),
                             TOLERANCE[torch.float32], names=NAMES)


def test_nan_in_a_term_propagates_to_its_row_only():
    q, k, v, rel_h, rel_w, _ = make_inputs(1, 1, 1, 20, (4, 5), 16)
    rel_w[0, 0, 7, 2] = float("nan")
    out = decomposed_attention(q, k, v, rel_h, rel_w, key_size=(4, 5))
    assert out[0, 0, 7].isnan().all() and not out[0, 0, torch.arange(20) != 7].isnan().any()


def test_opcheck():
    """Schema, fake tensors, autograd and AOT dispatch of the operators with a bias."""
    q, k, v, rel_h, rel_w, _ = make_inputs(1, 2, 1, 12, (3, 4), 16)
    args = (q, k, v, 1, -1, -1, 0, 0.25, 0.0, None, rel_h, rel_w, 4)
    torch.library.opcheck(local_attention_fwd, tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t
                                                     for t in args))
    out, lse = local_attention_fwd(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    torch.library.opcheck(local_attention_bwd, (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                                1, -1, -1, 0, 0.25, 0.0, None, rel_h.detach(), rel_w.detach(), 4))


@pytest.mark.parametrize("change, message", [
    (dict(key_size=(4, 4)), "key_size"),
    (dict(key_size=(3, "4")), "key_size"),
    (dict(rel_h=lambda t: t[..., :2]), "rel_h"),
    (dict(rel_w=lambda t: t.transpose(2, 3)), "rel_w"),
    (dict(rel_h=lambda t: t.to(torch.int32)), "rel_h"),
])
def test_bad_input_names_the_argument(change, message):
    q, k, v, rel_h, rel_w, _ = make_inputs(1, 2, 2, 12, (3, 4), 16)
    kwargs = dict(rel_h=rel_h, rel_w=rel_w, key_size=(3, 4))
    for name, value in change.items():
        kwargs[name] = value(kwargs[name]) if callable(value) else value
    with pytest.raises((TypeError, ValueError), match=f"decomposed_attention: `{message}`"):
        decomposed_attention(q, k, v, kwargs["rel_h"], kwargs["rel_w"], key_size=kwargs["key_size"])


def test_float64_computes_in_pytorch():
    q, k, v, rel_h, rel_w, do = make_inputs(1, 1, 1, 16, (4, 4), 8, torch.float64, device="cpu")
    ours = forward_backward(lambda *t: decomposed_attention(*t, key_size=(4, 4)), (q, k, v, rel_h, rel_w), do)
    assert_matches_reference(ours, reference(q, k, v, rel_h, rel_w, do, (4, 4)), 1e-12, names=NAMES)


# ----------------------------------------------------------------------- GPU
#: SAM's global blocks (1024 px, 640 px, 2048 px) and 14 x 14 windows, ViT-B/L's and ViT-H's
#: head dims, in bf16; float16 and float32 on the two layouts of the bias
GPU_CASES = [((4096, (64, 64), 64), torch.bfloat16), ((196, (14, 14), 64), torch.bfloat16),
             ((1600, (40, 40), 64), torch.bfloat16), ((196, (14, 14), 80), torch.bfloat16),
             ((4096, (64, 64), 80), torch.bfloat16), ((16384, (128, 128), 64), torch.bfloat16),
             ((4096, (64, 64), 64), torch.float16), ((196, (14, 14), 64), torch.float16),
             ((4096, (64, 64), 64), torch.float32), ((196, (14, 14), 80), torch.float32)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape, dtype", GPU_CASES,
                         ids=[f"{q}-{k[0]}x{k[1]}-d{d}-{str(t)[6:]}" for (q, k, d), t in GPU_CASES])
def test_gpu_sam_shapes(shape, dtype):
    """Against float64 on the GPU, output and every gradient."""
    queries, key_size, D = shape
    B = 2 if queries <= 4096 else 1
    q, k, v, rel_h, rel_w, do = make_inputs(B, 2, 2, queries, key_size, D, dtype, device="cuda")
    ours = forward_backward(lambda *t: decomposed_attention(*t, key_size=key_size), (q, k, v, rel_h, rel_w), do)
    chunk = 1024 if queries > 4096 else None

    def fn(q, k, v, rel_h, rel_w):
        return local_attention_reference(q, k, v, SEES_ALL, None, chunk=chunk, bias=dense_bias(rel_h, rel_w, key_size))
    expected = forward_backward(fn, (q, k, v, rel_h, rel_w), do, torch.float64)
    assert_matches_reference(ours, expected, TOLERANCE[dtype], names=NAMES)


@pytest.mark.cuda
def test_gpu_compiles_without_graph_break():
    torch._dynamo.reset()
    q, k, v, rel_h, rel_w, do = make_inputs(2, 4, 4, 1024, (32, 32), 64, torch.bfloat16, device="cuda")

    def attention(q, k, v, rel_h, rel_w):
        return decomposed_attention(q * 1.5, k, v, rel_h, rel_w, key_size=(32, 32)).relu()
    compiled = torch.compile(attention, fullgraph=True)
    for got, want in zip(forward_backward(compiled, (q, k, v, rel_h, rel_w), do),
                         forward_backward(attention, (q, k, v, rel_h, rel_w), do)):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 1e-2


@pytest.mark.parametrize("q_size, k_size, rows", [(14, 14, 27), (8, 8, 27), (20, 20, 27), (4, 7, 13), (9, 3, 17)])
def test_gathered_table_is_the_models_get_rel_pos(q_size, k_size, rows):
    """gathered_table against timm's and transformers' get_rel_pos (SAM's, which interpolates
    always, and ViTDet's): the same values and table gradients, bit for bit."""
    from timm.models.vision_transformer_sam import get_rel_pos as timm_get_rel_pos
    from timm_flashwin.ops.rel_pos import gathered_table
    table = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
    functions = [(timm_get_rel_pos, False)]
    try:
        from transformers.models.sam.modeling_sam import SamVisionAttention
        from transformers.models.vitdet.modeling_vitdet import get_rel_pos as vitdet_get_rel_pos
        functions += [(lambda q, k, t: SamVisionAttention.get_rel_pos(None, q, k, t), True), (vitdet_get_rel_pos, False)]
    except ImportError:
        pass
    for function, always in functions:
        results = []
        for fn in (function, lambda q, k, t: gathered_table(t, q, k, always)):
            leaf = table.clone().requires_grad_()
            out = fn(q_size, k_size, leaf)
            out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos())
            results.append((out.detach(), leaf.grad))
        assert all(torch.equal(a, b) for a, b in zip(*results))
