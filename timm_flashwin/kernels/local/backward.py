"""Backward kernels of the local-attention operators (FlashAttention-2's split).

* ``local_attention_bwd_dq_kernel`` runs first: one program per block of BLOCK_M queries,
  over the key blocks the forward visited (``local.tiles.key_schedule``); it computes its
  rows' delta_i = sum_d dO_id O_id (fp32) from the dO tile it loads anyway, stores it for
  the dkdv kernel, and writes dQ once, no atomics: deterministic. (FlashAttention-2 has a
  kernel of its own for delta: one launch more per backward, and short calls are bound by
  the host's launches.)
* ``local_attention_bwd_dkdv_kernel``: one program per block of BLOCK_N keys of one
  (batch, key/value head); it loops over the query heads of its group (grouped-query
  attention: their dK and dV summed in registers, nothing per query head in memory) and,
  per head, over the query blocks that see its keys (``local.tiles.query_schedule``), and
  writes dK and dV once, reading the delta the dq kernel stored.

P is recomputed from the forward's log2-sum-exp: P = exp2(scale * log2(e) * q.k - lse),
and dS = P * (dP - delta) with dP = dO V^T (times the dropout's keep / (1 - p), which the
kernels regenerate from the forward's seed). Rows that see no key have lse = +inf: P = 0.
"""
import triton
import triton.language as tl

from .bias import (bias_grad_init, bias_grad_step, bias_rows, row_tile_terms, score_bias, store_bias_grad,
                   tile_bias)
from .tiles import (count_tiles, dropout_keep, edge_block, full_block, head_base, load_block, load_rows,
                    pattern_limits, probabilities, product, program_block, query_block_program, query_schedule,
                    row_block, store_block)


@triton.jit
def load_row_stats(lse_head, delta_head, rows, S_q, MASKED: tl.constexpr):
    """(lse, delta) of query rows ``rows``: +inf and 0 beyond S_q, so that those rows' P is 0."""
    if MASKED:
        return (tl.load(lse_head + rows, mask=rows < S_q, other=float("inf")),
                tl.load(delta_head + rows, mask=rows < S_q, other=0.0))
    else:
        return tl.load(lse_head + rows), tl.load(delta_head + rows)


@triton.jit
def dkdv_step(dk, dv, k, v, q_head, do_head, lse_head, delta_head, m0, cols, id_base, seed, qk_scale, dropout_p,
              S_q, S_k, shift, period, before, after, sink, stride_qs, stride_qd, stride_gs, stride_gd,
              rel_h_ptr, rel_w_ptr, b, h, n0, key_w, stride_hb, stride_hh, stride_hs, stride_hk, stride_wb, stride_wh,
              stride_ws, stride_wk,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASKED: tl.constexpr, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              BIAS: tl.constexpr, ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr):
    """dK and dV of the program's keys ``cols`` (= n0 + arange(BLOCK_N)) plus the query block
    [m0, m0 + BLOCK_M) of head h, in the transposed orientation (keys as rows):
    P^T = exp2(K Q^T * qk_scale + bias^T - lse) (``local.bias``)."""
    offs = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    rows = m0 + offs
    q = load_rows(row_block(q_head, m0, stride_qs), offs, dims, stride_qs, stride_qd, S_q - m0, D, MASKED, BLOCK_D)
    do = load_rows(row_block(do_head, m0, stride_gs), offs, dims, stride_gs, stride_gd, S_q - m0, D, MASKED, BLOCK_D)
    lse, delta = load_row_stats(lse_head, delta_head, rows, S_q, MASKED)
    positions = rows + shift
    offset = lse[None, :]
    if BIAS != 0:  # exp2(x - (lse - bias)): the bias rides on the FMA's addend, the rows' term on lse
        rh_rows, rw_rows = bias_rows(rel_h_ptr, rel_w_ptr, b, h, rows, S_q, stride_hb, stride_hh, stride_hs,
                                     stride_wb, stride_wh, stride_ws, BIAS)
        tile, row_bias = score_bias(rh_rows, rw_rows, n0, tl.arange(0, BLOCK_N), S_k, key_w, stride_hk, stride_wk,
                                    BIAS, ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
        offset = (lse - row_bias)[None, :] - tile
    p = probabilities(k, q, positions[None, :], cols[:, None], qk_scale, offset, S_k, period, before, after,
                      sink, MASKED, HAS_SINK, PRECISION)
    dp = product(v, tl.trans(do), None, PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, id_base + rows, cols, dropout_p, True)
        dv = product((p * keep).to(do.dtype), do, dv, PRECISION)
        dp = dp * keep
    else:
        dv = product(p.to(do.dtype), do, dv, PRECISION)
    ds = p * (dp - delta[None, :])
    dk = product(ds.to(q.dtype), q, dk, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["period", "before", "after", "sink", "group", "key_w"])
def local_attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seed_ptr, counts_ptr, rel_h_ptr, rel_w_ptr,
    qk_scale, scale, dropout_p, S_q, S_k, H_kv, group, period, before, after, sink, key_w,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_hb, stride_hh, stride_hs, stride_hk,
    stride_wb, stride_wh, stride_ws, stride_wk,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PERIODIC: tl.constexpr, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    COUNT_TILES: tl.constexpr, BIAS: tl.constexpr, ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr,
    KEY_W_PAD: tl.constexpr,
):
    """Grid: (cdiv(S_k, BLOCK_N) * B * H_kv,). dk, dv like k, v (B, H_kv, S_k, D; any strides);
    q, dout (B, H_kv * group, S_q, D); lse, delta (B, H, S_q) fp32 contiguous; the bias's
    tensors as the forward's (``local.bias``)."""
    n_block, b, kvh = program_block(S_k, H_kv, BLOCK_N, False)
    period, before, after, sink, shift = pattern_limits(S_q, S_k, period, before, after, sink, PERIODIC)
    n0 = n_block * BLOCK_N
    n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail, partial = query_schedule(
        n0, S_q, S_k, shift, period, before, after, sink, BLOCK_N, BLOCK_M)
    count_tiles(counts_ptr, n_full * group, n_edge * group, COUNT_TILES)

    offs = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    cols = n0 + offs
    k = load_block(k_ptr, b, kvh, n0, stride_kb, stride_kh, stride_ks, stride_kd, offs, dims, S_k, D, BLOCK_D)
    v = load_block(v_ptr, b, kvh, n0, stride_vb, stride_vh, stride_vs, stride_vd, offs, dims, S_k, D, BLOCK_D)
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    H = H_kv * group
    for g in range(0, group):
        h = kvh * group + g
        q_head = head_base(q_ptr, b, h, stride_qb, stride_qh)
        do_head = head_base(dout_ptr, b, h, stride_gb, stride_gh)
        id_base = (b * H + h).to(tl.int64) * S_q
        lse_head = lse_ptr + id_base
        delta_head = delta_ptr + id_base
        for t in range(0, n_full):
            m0 = full_block(t, n_prefix, f_start) * BLOCK_M
            dk, dv = dkdv_step(dk, dv, k, v, q_head, do_head, lse_head, delta_head, m0, cols, id_base, seed,
                               qk_scale, dropout_p, S_q, S_k, shift, period, before, after, sink, stride_qs, stride_qd,
                               stride_gs, stride_gd, rel_h_ptr, rel_w_ptr, b, h, n0, key_w, stride_hb, stride_hh,
                               stride_hs, stride_hk, stride_wb, stride_wh, stride_ws, stride_wk,
                               D, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_SINK, HAS_DROPOUT, PRECISION, BIAS, ROW_TILE,
                               KEY_H_PAD, KEY_W_PAD)
        for t in range(0, n_edge):
            m0 = edge_block(t, e_start, n_lead, t_start, n_tail, partial) * BLOCK_M
            dk, dv = dkdv_step(dk, dv, k, v, q_head, do_head, lse_head, delta_head, m0, cols, id_base, seed,
                               qk_scale, dropout_p, S_q, S_k, shift, period, before, after, sink, stride_qs, stride_qd,
                               stride_gs, stride_gd, rel_h_ptr, rel_w_ptr, b, h, n0, key_w, stride_hb, stride_hh,
                               stride_hs, stride_hk, stride_wb, stride_wh, stride_ws, stride_wk,
                               D, BLOCK_M, BLOCK_N, BLOCK_D, True, HAS_SINK, HAS_DROPOUT, PRECISION, BIAS, ROW_TILE,
                               KEY_H_PAD, KEY_W_PAD)
    scale = tl.cast(scale, tl.float32)  # inductor passes Python floats as fp64
    store_block(dk_ptr, dk * scale, b, kvh, n0, stride_dkb, stride_dkh, stride_dks, stride_dkd, offs, dims, S_k, D,
                BLOCK_D)
    store_block(dv_ptr, dv, b, kvh, n0, stride_dvb, stride_dvh, stride_dvs, stride_dvd, offs, dims, S_k, D, BLOCK_D)


@triton.jit
def dq_step(dq, grad_h, grad_w, q, do, lse, delta, k_head, v_head, n0, rows, positions, row_ids, seed, qk_scale,
            dropout_p, S_q, S_k, period, before, after, sink, stride_ks, stride_kd, stride_vs, stride_vd,
            bias, row_bias, drh_rows, key_w, stride_hk,
            D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
            HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BIAS: tl.constexpr,
            ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr):
    """dQ of the program's queries ``rows`` (at ``positions``) plus the key block [n0, n0 + BLOCK_N),
    and the bias's gradient accumulators (grad_h, grad_w: ``local.bias.bias_grad_step``); ``bias``:
    the tile's bias, ``row_bias`` its rows' term (``local.bias.tile_bias``)."""
    offs = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    cols = n0 + offs
    k = load_rows(row_block(k_head, n0, stride_ks), offs, dims, stride_ks, stride_kd, S_k - n0, D, MASKED, BLOCK_D)
    v = load_rows(row_block(v_head, n0, stride_vs), offs, dims, stride_vs, stride_vd, S_k - n0, D, MASKED, BLOCK_D)
    offset = lse[:, None]
    if BIAS != 0:  # exp2(x - (lse - bias)), as in dkdv_step
        offset = (lse - row_bias)[:, None] - bias
    p = probabilities(q, k, positions[:, None], cols[None, :], qk_scale, offset, S_k, period, before, after,
                      sink, MASKED, HAS_SINK, PRECISION)
    dp = product(do, tl.trans(v), None, PRECISION)
    if HAS_DROPOUT:
        dp = dp * dropout_keep(seed, row_ids, cols, dropout_p, False)
    ds = p * (dp - delta[:, None])
    ds_operand = ds.to(k.dtype)
    if BIAS != 0:
        grad_h, grad_w = bias_grad_step(grad_h, grad_w, ds, ds_operand, n0, offs, rows, S_q, S_k, key_w, drh_rows,
                                        stride_hk, BIAS, ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
    return product(ds_operand, k, dq, PRECISION), grad_h, grad_w


@triton.jit(do_not_specialize=["period", "before", "after", "sink", "group", "key_w"])
def local_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, seed_ptr, counts_ptr,
    rel_h_ptr, rel_w_ptr, d_rel_h_ptr, d_rel_w_ptr,
    qk_scale, scale, dropout_p, S_q, S_k, H, group, period, before, after, sink, key_w,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_hb, stride_hh, stride_hs, stride_hk,
    stride_wb, stride_wh, stride_ws, stride_wk,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PERIODIC: tl.constexpr, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    COUNT_TILES: tl.constexpr, BIAS: tl.constexpr, ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr,
    KEY_W_PAD: tl.constexpr,
):
    """Grid: (cdiv(S_q, BLOCK_M) * B * H,). dq like q (any strides); out (the forward's) and
    dout (B, H, S_q, D) any strides; k, v (B, H / group, S_k, D); delta (B, H, S_q) fp32
    contiguous, written here. With BIAS, the bias's tensors as the forward's, and its
    gradients d_rel_h, d_rel_w of their shapes and strides, written here (``local.bias``;
    every pair of a row is visited: global attention)."""
    (b, h, m0, period, before, after, sink, n_full, n_prefix, f_start, n_edge, e_start, n_lead, t_start, n_tail,
     partial, shift) = query_block_program(counts_ptr, S_q, S_k, H, period, before, after, sink, PERIODIC, BLOCK_M,
                                           BLOCK_N, COUNT_TILES)
    offs = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    rows = m0 + offs
    q = load_block(q_ptr, b, h, m0, stride_qb, stride_qh, stride_qs, stride_qd, offs, dims, S_q, D, BLOCK_D)
    do = load_block(dout_ptr, b, h, m0, stride_gb, stride_gh, stride_gs, stride_gd, offs, dims, S_q, D, BLOCK_D)
    o = load_block(out_ptr, b, h, m0, stride_ob, stride_oh, stride_os, stride_od, offs, dims, S_q, D, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # 0 beyond S_q (zeros loaded)
    id_base = (b * H + h).to(tl.int64) * S_q
    tl.store(delta_ptr + id_base + rows, delta, mask=rows < S_q)
    lse = tl.load(lse_ptr + id_base + rows, mask=rows < S_q, other=float("inf"))
    k_head = head_base(k_ptr, b, h // group, stride_kb, stride_kh)
    v_head = head_base(v_ptr, b, h // group, stride_vb, stride_vh)
    row_ids = id_base + rows
    positions = rows + shift
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    rh_rows, rw_rows = bias_rows(rel_h_ptr, rel_w_ptr, b, h, rows, S_q, stride_hb, stride_hh, stride_hs, stride_wb,
                                 stride_wh, stride_ws, BIAS)
    drh_rows, drw_rows = bias_rows(d_rel_h_ptr, d_rel_w_ptr, b, h, rows, S_q, stride_hb, stride_hh, stride_hs,
                                   stride_wb, stride_wh, stride_ws, BIAS)
    grad_h, grad_w = bias_grad_init(BLOCK_M, BLOCK_N, BIAS, ROW_TILE, KEY_H_PAD, KEY_W_PAD)
    keys = tl.arange(0, BLOCK_N)
    rw_tile, rh_next = row_tile_terms(rh_rows, rw_rows, keys, S_k, key_w, stride_hk, stride_wk, BIAS, ROW_TILE,
                                      KEY_H_PAD, KEY_W_PAD)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for t in range(0, n_full):
        n0 = full_block(t, n_prefix, f_start) * BLOCK_N
        bias, row_bias, rh_next = tile_bias(rw_tile, rh_next, rh_rows, n0, keys, S_k, key_w, stride_hk, BIAS,
                                            ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
        dq, grad_h, grad_w = dq_step(dq, grad_h, grad_w, q, do, lse, delta, k_head, v_head, n0, rows, positions,
                                     row_ids, seed, qk_scale, dropout_p, S_q, S_k, period, before, after, sink,
                                     stride_ks, stride_kd, stride_vs, stride_vd, bias, row_bias, drh_rows, key_w,
                                     stride_hk,
                                     D, BLOCK_N, BLOCK_D, False, HAS_SINK, HAS_DROPOUT, PRECISION, BIAS, ROW_TILE,
                                     KEY_H_PAD, KEY_W_PAD)
    for t in range(0, n_edge):
        n0 = edge_block(t, e_start, n_lead, t_start, n_tail, partial) * BLOCK_N
        bias, row_bias, rh_next = tile_bias(rw_tile, rh_next, rh_rows, n0, keys, S_k, key_w, stride_hk, BIAS,
                                            ROW_TILE, KEY_H_PAD, KEY_W_PAD, PRECISION)
        dq, grad_h, grad_w = dq_step(dq, grad_h, grad_w, q, do, lse, delta, k_head, v_head, n0, rows, positions,
                                     row_ids, seed, qk_scale, dropout_p, S_q, S_k, period, before, after, sink,
                                     stride_ks, stride_kd, stride_vs, stride_vd, bias, row_bias, drh_rows, key_w,
                                     stride_hk,
                                     D, BLOCK_N, BLOCK_D, True, HAS_SINK, HAS_DROPOUT, PRECISION, BIAS, ROW_TILE,
                                     KEY_H_PAD, KEY_W_PAD)
    store_bias_grad(grad_h, grad_w, drh_rows, drw_rows, rows, S_q, S_k, key_w, stride_hk, stride_wk, BIAS, ROW_TILE,
                    BLOCK_N, KEY_H_PAD, KEY_W_PAD)
    scale = tl.cast(scale, tl.float32)  # inductor passes Python floats as fp64
    store_block(dq_ptr, dq * scale, b, h, m0, stride_dqb, stride_dqh, stride_dqs, stride_dqd, offs, dims, S_q, D,
                BLOCK_D)
