"""sliding_window_attention and block_sliding_window_attention: the Triton kernels (under the
interpreter on the CPU, with tiles of 16 so that small sequences take the multi-block
paths) against the float64 reference, output and dq, dk, dv; which tiles the kernels
visit; dropout with the kernels' own mask; the registered operators (opcheck, compile);
bad input. Which launch plans they take: test_local_plans.py. The GPU-only cases (long sequences, head_dim 256, every dtype at scale,
torch.compile with inductor, memory) are in test_local_attention_gpu.py."""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from opcases import TOLERANCE, assert_matches_reference
from timm_flashwin import block_sliding_window_attention, sliding_window_attention
from timm_flashwin.kernels.local import launch as local_launch, plan as local_plan
from timm_flashwin.ops.local_operators import local_attention_bwd, local_attention_fwd
from timm_flashwin.ops.local_reference import (LocalPattern, block_window_visible, local_attention_reference,
                                               sliding_window_visible)

NAMES = ("out", "dq", "dk", "dv")


def launch_forward(q, k, v, pattern, scale, dropout_p=0.0, seed=None, counts=None):
    """The forward's launch (``local_launch.local_forward``) for q, k, v and a pattern's numbers."""
    inputs = local_launch.LocalInputs(q, k, v, seed)
    call = local_launch.local_call(inputs, pattern, scale, dropout_p)
    return local_launch.local_forward(call, inputs, scale, dropout_p, counts)


def launch_backward(do, q, k, v, out, lse, pattern, scale, dropout_p=0.0, seed=None, counts=None):
    """The backward's launches: (dq, dk, dv)."""
    inputs = local_launch.LocalInputs(q, k, v, seed)
    call = local_launch.local_call(inputs, pattern, scale, dropout_p)
    return local_launch.local_backward(call, inputs, out, lse, do, scale, dropout_p, counts)[:3]


def lengths(S):
    """(S_q, S_k) of a case's S: an int (both) or a pair."""
    return (S, S) if isinstance(S, int) else S


def make_inputs(B, H, H_kv, S, D, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    S_q, S_k = lengths(S)
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, S_q, D, generator=g).to(dtype).to(device) for _ in range(2))
    k, v = (torch.randn(B, H_kv, S_k, D, generator=g).to(dtype).to(device) for _ in range(2))
    return q, k, v, do


def forward_backward(fn, q, k, v, do, dtype=None):
    """[out, dq, dk, dv] of ``fn(q, k, v)`` for the output gradient ``do``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def reference(visible, q, k, v, do, scale=None, chunk=None, **kwargs):
    return forward_backward(lambda *t: local_attention_reference(*t, visible, scale, chunk=chunk, **kwargs),
                            q, k, v, do, torch.float64)


def sliding(window, causal=False, **kwargs):
    return lambda q, k, v: sliding_window_attention(q, k, v, window=window, causal=causal, **kwargs)


def blocks(block_size, window_blocks, sink_tokens=0, **kwargs):
    return lambda q, k, v: block_sliding_window_attention(q, k, v, block_size=block_size,
                                                          window_blocks=window_blocks, sink_tokens=sink_tokens,
                                                          **kwargs)


def sliding_visible(window, causal=False):
    return sliding_window_visible(window[0], 0 if causal else window[1])


# (id, op, visible, (B, H, H_kv, S, D), dtype); S = 37 is not a multiple of the tile (16); S a
# pair (S_q, S_k): fewer or more queries than keys, the last query at the last key
CASES = [
    ("window0", sliding((0, 0)), sliding_visible((0, 0)), (1, 2, 2, 37, 16), torch.float32),
    ("window-3-5", sliding((3, 5)), sliding_visible((3, 5)), (1, 2, 2, 37, 16), torch.float32),
    ("global", sliding((None, None)), sliding_visible((None, None)), (1, 2, 2, 37, 16), torch.float32),
    ("window-over-S-Sq37-Sk11", sliding((100, 64)), sliding_visible((100, 64)), (1, 2, 2, (37, 11), 16),
     torch.float32),
    ("causal", sliding((None, None), True), sliding_visible((None, None), True), (1, 2, 2, 37, 16), torch.float32),
    ("causal-Sq20-Sk37", sliding((None, None), True), sliding_visible((None, None), True), (1, 2, 2, (20, 37), 16),
     torch.float32),
    ("causal-window-7", sliding((7, 3), True), sliding_visible((7, 3), True), (1, 2, 2, 37, 16), torch.float32),
    ("S1", sliding((None, None)), sliding_visible((None, None)), (2, 2, 1, 1, 16), torch.float32),
    ("mqa-window-10-3-f16-D24", sliding((10, 3)), sliding_visible((10, 3)), (1, 4, 1, 45, 24), torch.float16),
    ("window-5-2-bf16-D8", sliding((5, 2)), sliding_visible((5, 2)), (1, 2, 2, 33, 8), torch.bfloat16),
    ("blocks-5-2-sink3-Sq40-Sk33", blocks(5, 2, 3), block_window_visible(5, 2, 3), (1, 2, 2, (40, 33), 16),
     torch.float32),
    ("blocks-16-2-sink20", blocks(16, 2, 20), block_window_visible(16, 2, 20), (1, 2, 2, 50, 16), torch.float32),
    ("gqa-blocks-16-1", blocks(16, 1), block_window_visible(16, 1), (1, 4, 2, 40, 16), torch.float32),
    ("blocks-1-1", blocks(1, 1), block_window_visible(1, 1), (1, 1, 1, 20, 16), torch.float32),
    ("blocks-7-3-bf16-D24", blocks(7, 3), block_window_visible(7, 3), (1, 2, 2, 40, 24), torch.bfloat16),
    ("blocks-6-2-sink4-f16", blocks(6, 2, 4), block_window_visible(6, 2, 4), (1, 2, 1, 40, 16), torch.float16),
]


@pytest.mark.parametrize("fn,visible,shape,dtype", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_matches_float64_reference(fn, visible, shape, dtype):
    q, k, v, do = make_inputs(*shape, dtype=dtype)
    results = forward_backward(fn, q, k, v, do)
    expected = reference(visible, q, k, v, do)
    S_q, S_k = lengths(shape[3])
    if visible(torch.arange(S_q)[:, None] + S_k - S_q, torch.arange(S_k)[None, :]).sum(-1).eq(1).all():
        # one key per query: P = 1, dS = 0, dq = dk = 0 up to rounding
        for got in results[1:3]:
            assert got.abs().max() < 1e-5
        results, expected = results[::3], expected[::3]
        assert_matches_reference(results, expected, TOLERANCE[dtype], names=("out", "dv"))
        return
    assert_matches_reference(results, expected, TOLERANCE[dtype], names=NAMES)


def test_any_strides_and_a_broadcast_output_gradient():
    """q, k, v as views of (B, S, H, D) and of a wider tensor, the output gradient expanded
    (zero strides, as a sum's backward gives it): read as laid out; the output keeps q's
    layout."""
    B, H, S, D = 1, 2, 40, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, H, D, generator=g).to(KERNEL_DEVICE).transpose(1, 2)
    kv = torch.randn(B, H, S, 2 * D + 3, generator=g).to(KERNEL_DEVICE)
    k, v = kv[..., :D], kv[..., D + 3:]
    do = torch.randn(1, 1, 1, D, generator=g).to(KERNEL_DEVICE).expand(B, H, S, D)
    fn = blocks(8, 2, 2)
    results = forward_backward(fn, q, k, v, do)
    assert results[0].stride() == q.stride()
    assert_matches_reference(results, reference(block_window_visible(8, 2, 2), q, k, v, do), 1e-4, names=NAMES)


def test_scale_and_the_total_window_width_convention():
    """A total width w is window=(w - 1 - (w - 1) // 2, (w - 1) // 2): w keys per query away
    from the ends. With an explicit scale."""
    q, k, v, do = make_inputs(1, 1, 1, 24, 16)
    w = 6
    right = (w - 1) // 2
    visible = sliding_window_visible(w - 1 - right, right)
    assert visible(torch.arange(24)[:, None], torch.arange(24)[None, :])[8:16].sum(-1).eq(w).all()
    results = forward_backward(sliding((w - 1 - right, right), scale=0.3), q, k, v, do)
    assert_matches_reference(results, reference(visible, q, k, v, do, scale=0.3), 1e-4, names=NAMES)


@pytest.mark.parametrize("scale", [-0.7, 0.0])
def test_scales_that_are_not_positive(scale):
    """The forward folds a positive scale into the exponent's FMA (``local_plan.fold_scale``:
    the row maximum of the unscaled scores); a negative or zero scale takes the logits scaled
    first, where a masked score stays -inf (times a negative scale it would be +inf, times 0
    NaN). Window edges, a sink and a partial last block, so that masked tiles are visited."""
    assert local_plan.fold_scale(0.3, 16) and not local_plan.fold_scale(scale, 16)
    q, k, v, do = make_inputs(1, 2, 1, 45, 16, seed=3)
    results = forward_backward(blocks(8, 2, 3, scale=scale), q, k, v, do)
    assert_matches_reference(results, reference(block_window_visible(8, 2, 3), q, k, v, do, scale=scale), 1e-4,
                             names=NAMES)


# ----------------------------------------------------------------------- tiles visited
def expected_tiles(visible, S_q, S_k, rows_block, cols_block, transposed=False):
    """(tiles with no mask, tiles with one) a kernel should visit: every tile holding a
    visible pair; without a mask exactly those whose real pairs are all visible and whose
    visited dimension is a whole block (a partial last block is masked)."""
    seen = visible(torch.arange(S_q)[:, None] + S_k - S_q, torch.arange(S_k)[None, :])
    if transposed:
        seen = seen.T
    full = edge = 0
    for r in range(0, seen.shape[0], rows_block):
        for c in range(0, seen.shape[1], cols_block):
            tile = seen[r:r + rows_block, c:c + cols_block]
            if not tile.any():
                continue
            whole = bool(tile.all()) and c + cols_block <= seen.shape[1]
            full, edge = (full + 1, edge) if whole else (full, edge + 1)
    return full, edge


@pytest.mark.parametrize("pattern,visible,keys", [
    pytest.param(LocalPattern.sliding(20, 9), sliding_window_visible(20, 9), 1.0, id="window-20-9"),
    pytest.param(LocalPattern.sliding(None, 0), sliding_window_visible(None, 0), 1.6, id="causal-Sk1.6xSq"),
    pytest.param(LocalPattern.blocks(16, 2), block_window_visible(16, 2), 1.0, id="blocks-16-2"),
    pytest.param(LocalPattern.blocks(5, 3, 35), block_window_visible(5, 3, 35), 0.7, id="blocks-5-3-sink35-Sk0.7xSq"),
])
def test_kernels_visit_only_tiles_with_visible_pairs(pattern, visible, keys):
    """Tiles wholly outside the pattern are never visited, and, but around the sink, tiles
    wholly inside are visited without mask arithmetic (exact counts); with as many keys as
    queries, more and fewer (``keys`` times S)."""
    S = 90 if KERNEL_DEVICE == "cpu" else 1000  # the interpreter's tiles are 16, the GPU's 32 to 128
    S_k = int(S * keys)
    q, k, v, do = make_inputs(1, 1, 1, (S, S_k), 16)
    counts = torch.zeros(4, dtype=torch.int32, device=KERNEL_DEVICE)
    numbers = (pattern.period, pattern.before, pattern.after, pattern.sink)
    out, lse = launch_forward(q, k, v, numbers, 0.25, counts=counts[:2])
    forward = counts[:2].tolist()
    counts.zero_()
    launch_backward(do, q, k, v, out, lse, numbers, 0.25, counts=counts)
    dkdv, dq = counts[:2].tolist(), counts[2:].tolist()
    fwd_tiles, dq_tiles, dkdv_tiles = (local_plan.plan(kind, 16, q.dtype) for kind in ("fwd", "dq", "dkdv"))
    by_query = expected_tiles(visible, S, S_k, fwd_tiles.block_m, fwd_tiles.block_n)
    by_query_dq = expected_tiles(visible, S, S_k, dq_tiles.block_m, dq_tiles.block_n)
    by_key = expected_tiles(visible, S, S_k, dkdv_tiles.block_n, dkdv_tiles.block_m, transposed=True)
    assert sum(forward) == sum(by_query) and sum(dq) == sum(by_query_dq) and sum(dkdv) == sum(by_key)
    if pattern.sink:
        assert forward[0] <= by_query[0] and dq[0] <= by_query_dq[0] and dkdv[0] <= by_key[0]
    else:
        assert forward == list(by_query) and dq == list(by_query_dq) and dkdv == list(by_key)


def test_rows_without_keys_give_zero_not_nan():
    """An empty pattern (the API refuses one; the kernels take it from the launchers):
    output 0, log-sum-exp +inf, every gradient 0, nothing NaN."""
    q, k, v, do = make_inputs(1, 2, 1, 20, 16)
    empty = (1, 0, 0, 0)  # keys max(0, i) <= j < i: none
    out, lse = launch_forward(q, k, v, empty, 0.25)
    grads = launch_backward(do, q, k, v, out, lse, empty, 0.25)
    assert torch.isinf(lse).all() and (lse > 0).all()
    for t in (out, *grads):
        assert not t.isnan().any() and t.eq(0).all()


@pytest.mark.parametrize("scale", [0.25, -0.25])
def test_nan_propagates_as_in_the_reference(scale):
    """A NaN in one query row and in one key: the output is NaN exactly where the float64
    reference's is (that row, and every row that sees the key), finite elsewhere; with the
    forward's scale folded into its FMA (positive) and not (negative)."""
    q, k, v, _ = make_inputs(1, 1, 1, 40, 16, seed=5)
    q[0, 0, 3, 5] = float("nan")
    k[0, 0, 30, 0] = float("nan")
    out = blocks(8, 2, scale=scale)(q, k, v)
    expected = local_attention_reference(q.double(), k.double(), v.double(), block_window_visible(8, 2), scale)
    assert expected.isnan().any() and not expected.isnan().all()
    assert torch.equal(out.isnan().cpu(), expected.isnan().cpu())


# ----------------------------------------------------------------------- dropout
def _rng_state():
    return torch.cuda.get_rng_state() if KERNEL_DEVICE == "cuda" else torch.get_rng_state()


def _set_rng_state(state):
    (torch.cuda.set_rng_state if KERNEL_DEVICE == "cuda" else torch.set_rng_state)(state)


@pytest.mark.parametrize("fn,visible,shape,dtype", [
    pytest.param(sliding((6, 6), dropout_p=0.3), sliding_window_visible(6, 6), (1, 2, 1, (30, 37), 16),
                 torch.float32, id="sliding-gqa-f32-Sq30-Sk37"),
    pytest.param(blocks(8, 2, 3, dropout_p=0.3), block_window_visible(8, 2, 3), (1, 2, 2, 30, 16), torch.float16,
                 id="blocks-f16"),
])
def test_dropout_matches_reference_with_the_kernels_mask(fn, visible, shape, dtype):
    q, k, v, do = make_inputs(*shape, dtype=dtype)
    torch.manual_seed(5)
    state = _rng_state()
    ours = forward_backward(fn, q, k, v, do)
    _set_rng_state(state)  # the op drew its seed here: draw it again
    seed = torch.randint(0, 2 ** 62, (1,), device=q.device, dtype=torch.int64)
    queries, keys = lengths(shape[3])
    factor = local_launch.dropout_factors(seed, shape[0], shape[1], queries, 0.3, keys=keys)
    dropped = (factor == 0).float().mean().item()
    assert 0.2 < dropped < 0.4
    expected = reference(visible, q, k, v, do, dropout_factor=factor)
    assert_matches_reference(ours, expected, TOLERANCE[dtype], names=NAMES)


def test_dropout_same_seed_same_result_and_zero_draws_nothing():
    q, k, v, do = make_inputs(1, 1, 1, 20, 16)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(forward_backward(sliding((4, 4), dropout_p=0.5), q, k, v, do))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    state = _rng_state()
    sliding_window_attention(q, k, v, window=(4, 4), dropout_p=0.0)
    assert torch.equal(_rng_state(), state)


# ----------------------------------------------------------------------- PyTorch's path
def test_float64_and_plain_cpu_take_pytorch(monkeypatch):
    """float64 (any device) and, without the interpreter, CPU tensors: the reference's math
    with autograd, the same semantics."""
    from timm_flashwin.ops import local as local_attention
    q, k, v, do = make_inputs(1, 2, 1, 30, 16, dtype=torch.float64)
    visible = block_window_visible(4, 3, 2)
    ours = forward_backward(blocks(4, 3, 2), q, k, v, do)
    assert ours[0].dtype == torch.float64
    assert_matches_reference(ours, reference(visible, q, k, v, do), 1e-12, names=NAMES)
    monkeypatch.setattr(local_attention, "uses_kernels", lambda t: False)
    q32, k32, v32, do32 = (t.float().cpu() for t in (q, k, v, do))
    ours = forward_backward(sliding((3, 0), dropout_p=0.0), q32, k32, v32, do32)
    assert_matches_reference(ours, reference(sliding_window_visible(3, 0), q32, k32, v32, do32), 1e-5,
                             names=NAMES)


def test_pytorch_path_takes_long_sequences_a_chunk_of_queries_at_a_time(monkeypatch):
    """The PyTorch path computes REFERENCE_CHUNK query rows at a time, over the keys they
    see (no S x S scores): the same output and gradients as the whole, and no chunk's
    scores larger than chunk x (chunk + window)."""
    from timm_flashwin.ops import local as local_attention
    monkeypatch.setattr(local_attention, "REFERENCE_CHUNK", 64)
    widest = []
    softmax = torch.Tensor.softmax
    monkeypatch.setattr(torch.Tensor, "softmax", lambda t, *a, **kw: widest.append(t.shape[-1]) or softmax(t, *a, **kw))
    q, k, v, do = make_inputs(1, 2, 1, 300, 8, dtype=torch.float64)
    ours = forward_backward(sliding((20, 5)), q, k, v, do)
    assert widest and max(widest) <= 64 + 25 and len(widest) == 5, widest
    monkeypatch.setattr(torch.Tensor, "softmax", softmax)
    assert_matches_reference(ours, reference(sliding_window_visible(20, 5), q, k, v, do), 1e-12, names=NAMES)


# ----------------------------------------------------------------------- operators
def test_eager_path_equals_the_operator(monkeypatch):
    """In eager mode the kernels launch without the operator dispatch; outputs and gradients
    bit-equal to the registered operator's; without gradients no autograd node."""
    from timm_flashwin.ops import local as local_attention
    q, k, v, do = make_inputs(1, 2, 1, 20, 16)
    fn = blocks(4, 2, 1)
    calls = []
    real = local_attention.local_attention_fwd
    monkeypatch.setattr(local_attention, "local_attention_fwd", lambda *a: calls.append(1) or real(*a))
    eager = forward_backward(fn, q, k, v, do)
    with torch.no_grad():
        no_grad = fn(q, k, v)
    assert not calls and no_grad.grad_fn is None and torch.equal(no_grad, eager[0])
    monkeypatch.setattr(local_attention, "dispatch_free", lambda t: False)
    dispatched = forward_backward(fn, q, k, v, do)
    assert calls and all(torch.equal(a, b) for a, b in zip(eager, dispatched))


def test_opcheck():
    """Schema, fake tensors, autograd registration and AOT dispatch of the operator pair,
    with fewer queries than keys."""
    q, k, v, _ = make_inputs(1, 2, 1, (9, 13), 16)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 4, 3, 4, 2, 0.25, 0.0, None)
    torch.library.opcheck(local_attention_fwd, args)
    seed = torch.tensor([1234], dtype=torch.int64, device=KERNEL_DEVICE)
    torch.library.opcheck(local_attention_fwd, args[:-2] + (0.25, seed))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = local_attention_fwd(q, k, v, 1, -1, 1, 0, 0.25, 0.0, None)
    torch.library.opcheck(local_attention_bwd, (torch.ones_like(out), q, k, v, out, lse, 1, -1, 1, 0, 0.25, 0.0,
                                                None))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_no_launch_passes_a_tensor_it_writes_twice(dropout_p, monkeypatch):
    """Every tensor the launchers allocate (out, lse, delta, dq, dk, dv) goes to each kernel
    launch under one parameter only (local_launch's docstring says why: a traced launch
    clones each argument the kernel may write apart, and lse passed again as the forward's
    unused tile-count pointer came back as its never-written clone). The op's inputs may
    stand in for unused pointers (q for the seed without dropout)."""
    q, k, v, do = make_inputs(1, 2, 1, 9, 16)
    launches = []
    real = local_launch.launcher

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel, [a for a in args if isinstance(a, torch.Tensor)]))
                return real(self.kernel)[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(local_launch, "launcher", Recording)
    seed = torch.tensor([1234], dtype=torch.int64, device=KERNEL_DEVICE) if dropout_p else None
    pattern = (4, 3, 4, 2)
    out, lse = launch_forward(q, k, v, pattern, 0.25, dropout_p, seed)
    launch_backward(do, q, k, v, out, lse, pattern, 0.25, dropout_p, seed)
    assert len(launches) == 3  # forward, dq (with delta), dkdv
    for kernel, tensors in launches:
        inputs = [t for t in (q, k, v, do, seed) if t is not None]
        if kernel is not local_launch.local_attention_fwd_kernel:
            inputs += [out, lse]
        allocated = [t for t in tensors if not any(t is i for i in inputs)]
        pointers = [(t.untyped_storage().data_ptr(), t.storage_offset()) for t in allocated]
        assert len(set(pointers)) == len(pointers), getattr(kernel, "__name__", kernel)


def test_compiles_without_graph_break():
    """dynamo traces code calling both operators in one graph (fullgraph) and autograd goes
    through the registered backward."""
    q, k, v, do = make_inputs(1, 2, 1, 20, 16)

    def model(q, k, v):
        a = sliding_window_attention(q * 1.5, k, v, window=(3, 0), causal=True)
        return block_sliding_window_attention(a, k, v, block_size=4, window_blocks=2, sink_tokens=1).relu()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = forward_backward(compiled, q, k, v, do)
    assert_matches_reference(results, forward_backward(model, q, k, v, do), 1e-6, names=NAMES)


# ----------------------------------------------------------------------- bad input
def _bad(**changes):
    q, k, v, _ = make_inputs(1, 4, 2, 8, 16, device="cpu")
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return args


@pytest.mark.parametrize("call,exc,argument", [
    (lambda: sliding_window_attention(**_bad(q="x")), TypeError, "`q`"),
    (lambda: sliding_window_attention(**_bad(q=torch.zeros(4, 8, 16))), ValueError, "`q`"),
    (lambda: sliding_window_attention(**_bad(k=torch.zeros(1, 2, 8, 16, dtype=torch.float16))), TypeError, "`k`"),
    (lambda: sliding_window_attention(**_bad(q=torch.zeros(1, 4, 8, 16, dtype=torch.int32))), TypeError, "`q`"),
    (lambda: sliding_window_attention(**_bad(k=torch.zeros(1, 3, 8, 16))), ValueError, "`k`"),
    (lambda: sliding_window_attention(**_bad(k=torch.zeros(1, 2, 8, 8))), ValueError, "`k`"),
    (lambda: sliding_window_attention(**_bad(v=torch.zeros(1, 2, 8, 8))), ValueError, "`v`"),
    (lambda: sliding_window_attention(**_bad(q=torch.zeros(1, 4, 8, 300), k=torch.zeros(1, 2, 8, 300),
                                             v=torch.zeros(1, 2, 8, 300))), ValueError, "`q`"),
    (lambda: sliding_window_attention(**_bad(), window=(-1, 2)), ValueError, "`window[0] (left)`"),
    (lambda: sliding_window_attention(**_bad(), window=(1, 2.0)), TypeError, "`window[1] (right)`"),
    (lambda: sliding_window_attention(**_bad(), window=3), TypeError, "`window`"),
    (lambda: sliding_window_attention(**_bad(), causal=1), TypeError, "`causal`"),
    (lambda: sliding_window_attention(**_bad(), scale="1"), TypeError, "`scale`"),
    (lambda: sliding_window_attention(**_bad(), scale=float("nan")), ValueError, "`scale`"),
    (lambda: sliding_window_attention(**_bad(), dropout_p=1.0), ValueError, "`dropout_p`"),
    (lambda: block_sliding_window_attention(**_bad(), block_size=0, window_blocks=1), ValueError, "`block_size`"),
    (lambda: block_sliding_window_attention(**_bad(), block_size=4.0, window_blocks=1), TypeError, "`block_size`"),
    (lambda: block_sliding_window_attention(**_bad(), block_size=4, window_blocks=0), ValueError,
     "`window_blocks`"),
    (lambda: block_sliding_window_attention(**_bad(), block_size=4, window_blocks=1, sink_tokens=-1), ValueError,
     "`sink_tokens`"),
    (lambda: block_sliding_window_attention(**_bad(), block_size=4, window_blocks=True), TypeError,
     "`window_blocks`"),
])
def test_bad_input_names_the_argument(call, exc, argument):
    with pytest.raises(exc, match=argument.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        call()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_inputs_on_two_devices_are_refused():
    q, k, v, _ = make_inputs(1, 2, 2, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="`k`"):
        sliding_window_attention(q, k.cuda(), v)
