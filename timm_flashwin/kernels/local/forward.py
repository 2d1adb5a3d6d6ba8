"""Forward kernel of the local-attention operators: O = softmax(scale * Q K^T over the
visible pairs) V, flash style (online softmax over key blocks, nothing of size S x S).

One program owns one block of BLOCK_M queries of one (batch, head) and visits the key
blocks ``local.tiles.key_schedule`` gives it: those wholly visible to every one of its
queries without any mask arithmetic, the others (the window's edges, a partial last block,
the sink's last block) with it; no other key block is read. The key/value head of query
head h is h // group (grouped-query attention). With attention dropout the normalizer sums
the undropped probabilities and only their product with V is dropped, as
F.scaled_dot_product_attention applies it.
"""
import triton
import triton.language as tl

from .bias import bias_rows, row_tile_terms, tile_bias
from .tiles import (dropout_keep, edge_block, full_block, head_base, load_block, load_rows, logits, product,
                    query_block_program, row_block, scores, store_block)

#: the running maximum's start: finite, so that a row none of whose keys a block shows
#: gets exp2(-inf - m) = 0 and a factor exp2(m - m) = 1, never NaN
_NO_MAX = tl.constexpr(-1.0e30)


@triton.jit
def forward_step(acc, m_i, l_i, q, k_head, v_head, n0, positions, row_ids, seed, qk_scale, dropout_p,
                 S_k, period, before, after, sink, stride_ks, stride_kd, stride_vs, stride_vd, bias, row_bias,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                 HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                 FOLD_SCALE: tl.constexpr, BIAS: tl.constexpr):
    """The online softmax over the key block [n0, n0 + BLOCK_N) for the query rows at
    ``positions`` (``local.tiles``): (acc, m_i, l_i) updated. Without MASKED every key is
    < S_k and visible to every query row. FOLD_SCALE (only where
    qk_scale > 0 and there is no bias): the scale applied in the exponent's FMA, not to the
    logits first. BIAS: the tile's terms (log2 domain, ``local.bias.tile_bias``) are added:
    ``bias`` to each logit, ``row_bias`` (a vector, or 0.0) to each row's, within the row
    maximum and the exponent's subtrahend: m = max(m, max(s) + r), P = exp2(s - (m - r))."""
    offs = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    cols = n0 + offs
    k = load_rows(row_block(k_head, n0, stride_ks), offs, dims, stride_ks, stride_kd, S_k - n0, D, MASKED, BLOCK_D)
    if FOLD_SCALE:
        # the row maximum of the unscaled scores, scaled (a positive scale keeps their order),
        # and P = exp2(score * qk_scale - max): one FMA per logit where scaling first, then
        # subtracting, took two FP32 instructions (``local.launch.fold_scale``)
        s = scores(q, k, positions[:, None], cols[None, :], S_k, period, before, after, sink, MASKED, HAS_SINK,
                   PRECISION)
        scale32 = tl.cast(qk_scale, tl.float32)  # inductor passes Python floats as fp64
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale32)
        p = tl.math.exp2(tl.fma(s, scale32, -m_new[:, None]))
    else:
        s = logits(q, k, positions[:, None], cols[None, :], qk_scale, S_k, period, before, after, sink, MASKED,
                   HAS_SINK, PRECISION)
        if BIAS != 0:  # (-inf where hidden stays -inf; no add of 0.0 per logit without a bias)
            s += bias  # one FMA with the scale's multiply where not masked
            m_new = tl.maximum(m_i, tl.max(s, 1) + row_bias)
            p = tl.math.exp2(s - (m_new - row_bias)[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = p * dropout_keep(seed, row_ids, cols, dropout_p, False)
    v = load_rows(row_block(v_head, n0, stride_vs), offs, dims, stride_vs, stride_vd, S_k - n0, D, MASKED, BLOCK_D)
    acc = product(p.to(v.dtype), v, acc * alpha[:, None], PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["period", "before", "after", "sink", "group", "key_w"])
def local_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seed_ptr, counts_ptr, rel_h_ptr, rel_w_ptr, qk_scale, dropout_p,
    S_q, S_k, H, group, period, before, after, sink, key_w,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_hb, stride_hh, stride_hs, stride_hk,
    stride_wb, stride_wh, stride_ws, stride_wk,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PERIODIC: tl.constexpr, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    COUNT_TILES: tl.constexpr, FOLD_SCALE: tl.constexpr, BIAS: tl.constexpr, ROW_TILE: tl.constexpr,
    KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr,
):
    """Grid: (cdiv(S_q, BLOCK_M) * B * H,). q (B, H, S_q, D), k and v (B, H / group, S_k, D),
    out like q, any strides; lse (B, H, S_q) fp32, contiguous: each row's log2-sum-exp of its
    log2-domain logits (qk_scale = scale * log2(e)), +inf for a row that sees no key (its
    output is 0). ``before`` / ``after``: -1 for unlimited (``local.tiles``). With BIAS, the
    bias's tensors and the key grid's width ``key_w`` (``local.bias``; rel_h's strides
    stride_h*, rel_w's stride_w*; the grid's sides padded, KEY_H_PAD and KEY_W_PAD)."""
    (b, h, m0, period, before, after, sink, n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail,
     partial, shift) = query_block_program(counts_ptr, S_q, S_k, H, period, before, after, sink, PERIODIC, BLOCK_M,
                                           BLOCK_N, COUNT_TILES)
    offs = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    rows = m0 + offs
    q = load_block(q_ptr, b, h, m0, stride_qb, stride_qh, stride_qs, stride_qd, offs, dims, S_q, D, BLOCK_D)
    k_head = head_base(k_ptr, b, h // group, stride_kb, stride_kh)
    v_head = head_base(v_ptr, b, h // group, stride_vb, stride_vh)
    row_ids = (b * H + h).to(tl.int64) * S_q + rows
    positions = rows + shift
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    rh_rows, rw_rows = bias_rows(rel_h_ptr, rel_w_ptr, b, h, rows, S_q, stride_hb, stride_hh, stride_hs, stride_wb,
                                 stride_wh, stride_ws, BIAS)
    keys = tl.arange(0, BLOCK_N)
    rw_tile, rh_next = row_tile_terms(rh_rows, rw_rows, keys, S_k, key_w, stride_hk, stride_wk, BIAS, ROW_TILE,
                                      KEY_H_PAD, KEY_W_PAD)

    m_i = tl.full((BLOCK_M,), _NO_MAX, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for t in range(0, n_full):
        n0 = full_block(t, n_prefix, f_start) * BLOCK_N
        bias, row_bias, rh_next = tile_bias(rw_tile, rh_next, rh_rows, n0, keys, S_k, key_w, stride_hk, BIAS,
                                            ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
        acc, m_i, l_i = forward_step(acc, m_i, l_i, q, k_head, v_head, n0, positions, row_ids, seed, qk_scale,
                                     dropout_p, S_k, period, before, after, sink, stride_ks, stride_kd, stride_vs,
                                     stride_vd, bias, row_bias, D, BLOCK_N, BLOCK_D, False, HAS_SINK, HAS_DROPOUT,
                                     PRECISION, FOLD_SCALE, BIAS)
    for t in range(0, n_edge):
        n0 = edge_block(t, e_start, n_lead, t_start, n_tail, partial) * BLOCK_N
        bias, row_bias, rh_next = tile_bias(rw_tile, rh_next, rh_rows, n0, keys, S_k, key_w, stride_hk, BIAS,
                                            ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
        acc, m_i, l_i = forward_step(acc, m_i, l_i, q, k_head, v_head, n0, positions, row_ids, seed, qk_scale,
                                     dropout_p, S_k, period, before, after, sink, stride_ks, stride_kd, stride_vs,
                                     stride_vd, bias, row_bias, D, BLOCK_N, BLOCK_D, True, HAS_SINK, HAS_DROPOUT,
                                     PRECISION, FOLD_SCALE, BIAS)

    seen = l_i > 0.0
    l_i = tl.where(seen, l_i, 1.0)
    out = acc / l_i[:, None]
    store_block(out_ptr, out, b, h, m0, stride_ob, stride_oh, stride_os, stride_od, offs, dims, S_q, D, BLOCK_D)
    lse = tl.where(seen, m_i + tl.math.log2(l_i), float("inf"))
    tl.store(lse_ptr + (b * H + h).to(tl.int64) * S_q + rows, lse, mask=rows < S_q)


@triton.jit
def local_dropout_factor_kernel(seed_ptr, out_ptr, dropout_p, S_q, S_k, BLOCK: tl.constexpr):
    """Tests only. Grid: (B * H, cdiv(S_q, BLOCK), cdiv(S_k, BLOCK)); out (B * H, S_q, S_k)
    fp32: keep / (1 - p) as the kernels draw it for (b * H + h, i, j)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    factor = dropout_keep(tl.load(seed_ptr), bh * S_q + rows, cols, dropout_p, False)
    ptrs = out_ptr + (bh * S_q + rows[:, None]) * S_k + cols[None, :]
    tl.store(ptrs, factor, mask=(rows[:, None] < S_q) & (cols[None, :] < S_k))
