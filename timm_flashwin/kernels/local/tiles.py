"""Triton building blocks of the local-attention kernels (``local.forward``, ``local.backward``).

The pattern (``local_reference.LocalPattern``) over S_q queries and S_k keys: query i sits
at position p(i) = i + S_k - S_q (FlashAttention-2's bottom-right alignment: the last query
at the last key; p = i where S_q = S_k; the kernels move p to be >= 0, ``pattern_limits``),
and with base(p) = floor(p / period) * period it
attends keys lo(p) <= j < hi(p), lo(p) = max(0, base(p) - before),
hi(p) = min(S_k, base(p) + after), and the sink keys j < sink. lo and hi never decrease with
p and hi(p) >= lo(p + 1), so the keys a block of queries [m0, m1] can see are one range
[lo(p(m0)), hi(p(m1))) (plus the sink), those all of them see [lo(p(m1)), hi(p(m0))); the
same holds the other way, for the queries that see a block of keys (``query_bounds``). The
kernels visit the blocks of the first range only, the blocks of the second without any
mask arithmetic (``block_schedule``).

Logits are log2-domain (scale * log2(e) * q.k) so that the softmax uses exp2; the
forward saves each row's log2-sum-exp for the backward.
"""
import triton
import triton.language as tl


#: how ``product`` multiplies (an int: inductor passes constexprs of user kernels on as literals)
NATIVE, IEEE, TF32X3 = 0, 1, 2


@triton.jit
def product(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b (acc None: 0) with fp32 accumulation. PRECISION 0 (NATIVE): the operands as
    they are, on the tensor cores (16-bit inputs); else both in fp32: 1 (IEEE) exact fp32
    products (the interpreter, whose bf16 dot is wrong: it multiplies the bit patterns),
    2 (TF32X3) float32 inputs on the GPU (three tf32 products per product, ~2^-21 relative,
    on the tensor cores: exact products run on the FMA units and spill their tiles,
    tests/local_arch_build.py)."""
    if PRECISION == 0:
        return tl.dot(a, b, acc)
    elif PRECISION == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def pattern_limits(S_q, S_k, period, before, after, sink, PERIODIC: tl.constexpr):
    """The pattern as the kernels use it: (period, before, after, sink, shift).

    ``period`` the constant 1 without PERIODIC (a sliding window: its divisions fold away;
    a constexpr rather than Triton's specialization of integers equal to 1, so that block
    sizes never recompile a kernel, it never specializes ``period``). The positions are moved
    to be >= 0, so that base(p) is one truncating division per element: S_k - S_q =
    shift_hi + shift, shift_hi a multiple of the period (floor), shift in [0, period); query
    i is taken at i + shift and shift_hi moves into the bounds (before - shift_hi,
    after + shift_hi: the same keys). Unlimited sides (-1) and larger ones are clamped where
    they stop mattering for positions >= 0: ``before`` at S_k (base(p) < S_k), ``after`` +
    shift_hi at S_k; the sink within the keys. Every bound then stays within
    [-2 (S_q + S_k), 2 (S_q + S_k)] (int32 for S up to 2^28). (Clamped at S_q + S_k in the
    true positions, the sm_90 build of the head_dim-64 forward took 168 registers, not 132.)"""
    if not PERIODIC:
        period = 1
    shift_hi = floor_div(S_k - S_q, period) * period
    before = tl.where(before < 0, S_k, tl.minimum(before, S_k)) - shift_hi
    after = tl.where(after < 0, S_k, tl.minimum(after + shift_hi, S_k))
    return period, before, after, tl.minimum(sink, S_k), S_k - S_q - shift_hi


@triton.jit
def floor_div(x, d):
    """floor(x / d) for d > 0 (Triton's // truncates); for the scalars that may be negative."""
    return tl.where(x < 0, (x - d + 1) // d, x // d)


@triton.jit
def key_bounds(p, S_k, period, before, after):
    """[lo(p), hi(p)): the window keys of the query at position p >= 0 (a scalar or a vector)."""
    base = (p // period) * period
    return tl.maximum(base - before, 0), tl.minimum(base + after, S_k)


@triton.jit
def query_bounds(j, S_q, shift, period, before, after):
    """[first, end): the queries (indices i, at positions i + shift) whose window holds key
    j, i.e. hi > j and lo <= j."""
    first = -floor_div(after - 1 - j, period) * period  # the first base with base + after > j
    end = (floor_div(j + before, period) + 1) * period  # past the last base with base - before <= j
    return tl.minimum(tl.maximum(first - shift, 0), S_q), tl.minimum(tl.maximum(end - shift, 0), S_q)


@triton.jit
def visible(positions, cols, S_k, period, before, after, sink, HAS_SINK: tl.constexpr):
    """Whether the queries at ``positions`` (>= 0, ``pattern_limits``) attend key ``cols`` (broadcast against each
    other: positions[:, None] and cols[None, :] for a (query, key) tile, the other way round
    for a transposed one). Keys beyond S_k are never visible (hi <= S_k); queries beyond S_q
    may be, where the caller does not neutralize them."""
    lo, hi = key_bounds(positions, S_k, period, before, after)
    seen = (cols >= lo) & (cols < hi)
    if HAS_SINK:
        seen = seen | (cols < sink)
    return seen


@triton.jit
def block_schedule(u_lo, u_hi, f_lo, f_hi, prefix, BLOCK: tl.constexpr):
    """Which blocks of BLOCK positions a program visits, and how.

    [u_lo, u_hi): the positions some of its rows pair with, [f_lo, f_hi): those all of them
    pair with (a subrange), and besides [0, prefix) (the sink keys), which all of them pair
    with. Returns (n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail,
    partial): n_full blocks without a mask, 0 ... n_prefix - 1 (whole in the prefix) then
    f_start, f_start + 1, ... (whole in [f_lo, f_hi)); and n_edge blocks with a mask,
    n_lead from e_start, n_tail from t_start, and last, where it is neither, the prefix's
    partly covered block ``partial``. Every block that meets [0, prefix) or [u_lo, u_hi)
    is visited once and no other (``full_block``, ``edge_block``)."""
    n_prefix = prefix // BLOCK
    prefix_end = (prefix + BLOCK - 1) // BLOCK
    e_start = tl.maximum(u_lo // BLOCK, prefix_end)  # the window's blocks after the prefix's
    b_end = tl.maximum((u_hi + BLOCK - 1) // BLOCK, e_start)
    f_start = tl.maximum((f_lo + BLOCK - 1) // BLOCK, n_prefix)
    f_end = f_hi // BLOCK
    empty = f_end <= f_start
    f_start = tl.where(empty, b_end, f_start)
    f_end = tl.where(empty, b_end, f_end)
    n_lead = tl.maximum(tl.minimum(f_start, b_end) - e_start, 0)
    t_start = tl.maximum(f_end, e_start)
    n_tail = b_end - t_start
    partial = n_prefix
    n_partial = (prefix_end > n_prefix) & ((partial < f_start) | (partial >= f_end))
    return (n_prefix + f_end - f_start, n_prefix, f_start, n_lead + n_tail + n_partial.to(tl.int32), e_start,
            n_lead, t_start, n_tail, partial)


@triton.jit
def full_block(t, n_prefix, f_start):
    """The t-th block without a mask (``block_schedule``)."""
    return tl.where(t < n_prefix, t, f_start + t - n_prefix)


@triton.jit
def edge_block(t, e_start, n_lead, t_start, n_tail, partial):
    """The t-th block with a mask (``block_schedule``)."""
    return tl.where(t < n_lead, e_start + t, tl.where(t < n_lead + n_tail, t_start + t - n_lead, partial))


@triton.jit
def program_block(S, H, BLOCK: tl.constexpr, REVERSED: tl.constexpr):
    """(block, b, h) of this program: grid (cdiv(S, BLOCK) * B * H,), the blocks of one
    (b, h) consecutive (they share most of their keys: L2 hits), REVERSED to start with the
    last, which see the most keys under a causal pattern (shorter tail)."""
    num = tl.cdiv(S, BLOCK)
    pid = tl.program_id(0)
    block = pid % num
    if REVERSED:
        block = num - 1 - block
    bh = pid // num
    b = bh // H
    return block, b, bh - b * H


@triton.jit
def key_schedule(m0, S_q, S_k, shift, period, before, after, sink, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``block_schedule`` of the key blocks the queries [m0, m0 + BLOCK_M) see."""
    m_last = tl.minimum(m0 + BLOCK_M, S_q) - 1
    u_lo, f_hi = key_bounds(m0 + shift, S_k, period, before, after)
    f_lo, u_hi = key_bounds(m_last + shift, S_k, period, before, after)
    return block_schedule(u_lo, u_hi, f_lo, f_hi, sink, BLOCK_N)


@triton.jit
def query_schedule(n0, S_q, S_k, shift, period, before, after, sink, BLOCK_N: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """``block_schedule`` of the query blocks that see the keys [n0, n0 + BLOCK_N): every
    query sees a sink key."""
    n_last = tl.minimum(n0 + BLOCK_N, S_k) - 1
    u_lo, _ = query_bounds(n0, S_q, shift, period, before, after)
    f_lo, u_hi = query_bounds(n_last, S_q, shift, period, before, after)
    # all of the block's keys before the sink's end are seen by every query: the window
    # must hold the others
    _, f_hi = query_bounds(tl.maximum(n0, tl.minimum(sink, n_last)), S_q, shift, period, before, after)
    u_lo = tl.where(n0 < sink, 0, u_lo)
    u_hi = tl.where(n0 < sink, S_q, u_hi)
    f_lo = tl.where(n_last < sink, 0, f_lo)
    f_hi = tl.where(n_last < sink, S_q, f_hi)
    return block_schedule(u_lo, u_hi, f_lo, f_hi, 0, BLOCK_M)


@triton.jit
def query_block_program(counts_ptr, S_q, S_k, H, period, before, after, sink, PERIODIC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COUNT_TILES: tl.constexpr):
    """The start of a program over a block of queries (the forward, the dq kernel): its
    batch b, head h, first query m0, the pattern's limits (``pattern_limits``, its shift last)
    and the key blocks it visits (``key_schedule``'s nine numbers)."""
    m_block, b, h = program_block(S_q, H, BLOCK_M, True)
    period, before, after, sink, shift = pattern_limits(S_q, S_k, period, before, after, sink, PERIODIC)
    m0 = m_block * BLOCK_M
    n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail, partial = key_schedule(
        m0, S_q, S_k, shift, period, before, after, sink, BLOCK_M, BLOCK_N)
    count_tiles(counts_ptr, n_full, n_edge, COUNT_TILES)
    return (b, h, m0, period, before, after, sink, n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail,
            partial, shift)


@triton.jit
def hide_invisible(x, positions, cols, S_k, period, before, after, sink, MASKED: tl.constexpr,
                   HAS_SINK: tl.constexpr):
    """The tile ``x``, -inf where MASKED and the queries at ``positions`` do not attend key
    ``cols`` (broadcast as ``visible`` takes them); ``x`` as it is without MASKED."""
    if MASKED:
        x = tl.where(visible(positions, cols, S_k, period, before, after, sink, HAS_SINK), x, float("-inf"))
    return x


@triton.jit
def scores(a, b, positions, cols, S_k, period, before, after, sink, MASKED: tl.constexpr, HAS_SINK: tl.constexpr,
           PRECISION: tl.constexpr):
    """a @ b^T (fp32, unscaled), -inf where hidden (``hide_invisible``)."""
    return hide_invisible(product(a, tl.trans(b), None, PRECISION), positions, cols, S_k, period, before, after,
                          sink, MASKED, HAS_SINK)


@triton.jit
def logits(a, b, positions, cols, qk_scale, S_k, period, before, after, sink, MASKED: tl.constexpr,
           HAS_SINK: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b^T times qk_scale (log2-domain logits, fp32), -inf where hidden
    (``hide_invisible``): the forward's logits where its scale is not folded into the
    exponent (``local.launch.fold_scale``: head_dim above 64, or a scale that is not
    positive, whose sign would turn a masked -inf score into +inf)."""
    # tl.cast: inductor passes Python floats as fp64, which would make the tiles fp64
    s = product(a, tl.trans(b), None, PRECISION) * tl.cast(qk_scale, tl.float32)
    return hide_invisible(s, positions, cols, S_k, period, before, after, sink, MASKED, HAS_SINK)


@triton.jit
def probabilities(a, b, positions, cols, qk_scale, lse, S_k, period, before, after, sink, MASKED: tl.constexpr,
                  HAS_SINK: tl.constexpr, PRECISION: tl.constexpr):
    """The backward's P = exp2(a @ b^T * qk_scale - lse) (``lse`` broadcast against the tile),
    0 where hidden (``hide_invisible``). The scale's multiply and the subtraction are one
    ``tl.fma`` per logit (one FP32 instruction fewer than scaling the logits first),
    whatever the launch's FMA contraction option (traced launches leave Triton's default)."""
    x = tl.fma(product(a, tl.trans(b), None, PRECISION), tl.cast(qk_scale, tl.float32), -lse)
    return tl.math.exp2(hide_invisible(x, positions, cols, S_k, period, before, after, sink, MASKED, HAS_SINK))


@triton.jit
def count_tiles(counts_ptr, n_full, n_edge, COUNT_TILES: tl.constexpr):
    """Tests only (COUNT_TILES): add the program's tiles without and with a mask to
    counts[0] and counts[1]."""
    if COUNT_TILES:
        tl.atomic_add(counts_ptr, n_full)
        tl.atomic_add(counts_ptr + 1, n_edge)


@triton.jit
def load_rows(base, rows, dims, stride_s, stride_d, S, D: tl.constexpr, CHECK_ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """The (len(rows), BLOCK_D) tile of a (S, D) matrix at ``base`` (0 beyond either);
    without CHECK_ROWS every row is known to be < S. ``rows`` are relative to ``base``'s
    row 0, which the caller moves in int64 (``row_block``)."""
    ptrs = base + rows[:, None] * stride_s + dims[None, :] * stride_d
    if CHECK_ROWS and BLOCK_D != D:
        return tl.load(ptrs, mask=(rows[:, None] < S) & (dims[None, :] < D), other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=rows[:, None] < S, other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=dims[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_rows(base, tile, rows, dims, stride_s, stride_d, S, D: tl.constexpr, BLOCK_D: tl.constexpr):
    ptrs = base + rows[:, None] * stride_s + dims[None, :] * stride_d
    if BLOCK_D != D:
        tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows[:, None] < S) & (dims[None, :] < D))
    else:
        tl.store(ptrs, tile.to(base.dtype.element_ty), mask=rows[:, None] < S)


@triton.jit
def load_block(ptr, b, h, start, stride_b, stride_h, stride_s, stride_d, offs, dims, S, D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows start + offs of head h of batch b of a (B, H, S, D) tensor (0 beyond S or D)."""
    return load_rows(row_block(head_base(ptr, b, h, stride_b, stride_h), start, stride_s), offs, dims, stride_s,
                     stride_d, S - start, D, True, BLOCK_D)


@triton.jit
def store_block(ptr, tile, b, h, start, stride_b, stride_h, stride_s, stride_d, offs, dims, S, D: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """``tile`` into rows start + offs (those < S) of head h of batch b (``load_block``)."""
    store_rows(row_block(head_base(ptr, b, h, stride_b, stride_h), start, stride_s), tile, offs, dims, stride_s,
               stride_d, S - start, D, BLOCK_D)


@triton.jit
def head_base(ptr, b, h, stride_b, stride_h):
    """Row 0 of batch b, head h: the offsets in int64 (B * H * S * D may pass 2^31)."""
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def row_block(base, start, stride_s):
    """Row ``start`` of a head (``head_base``), moved in int64: S * stride_s may pass 2^31."""
    return base + start.to(tl.int64) * stride_s


@triton.jit
def dropout_keep(seed, row_ids, cols, dropout_p, TRANSPOSED: tl.constexpr):
    """keep / (1 - p) (fp32) for the tile of queries ``row_ids`` (their (b * H + h) * S + i)
    and keys ``cols``: (rows, cols), or (cols, rows) with TRANSPOSED. One Philox draw per
    (b, h, i, j) with counters (j, (b * H + h) * S + i): every kernel, whatever its tiling
    or orientation, regenerates the forward's mask. Multiplied by (not selected with), so a
    NaN probability stays NaN where dropped."""
    p = tl.cast(dropout_p, tl.float32)
    if TRANSPOSED:
        keys = cols[:, None] + 0 * row_ids[None, :]
        queries = row_ids[None, :] + 0 * cols[:, None]
    else:
        keys = cols[None, :] + 0 * row_ids[:, None]
        queries = row_ids[:, None] + 0 * cols[None, :]
    bits, _, _, _ = tl.philox(seed, keys.to(tl.uint32), queries.to(tl.uint32), 0, 0)
    keep = tl.uint_to_uniform_float(bits) >= p
    return tl.where(keep, 1.0 / (1.0 - p), 0.0)
