"""Backward kernels of windows larger than one tile that complete what the dkdv kernel
does not (``backward``'s docstring has the math, ``plan`` picks them): dQ by its own
pass over the key blocks (``window_attention_bwd_dq_kernel``) or from the dkdv kernel's
fp32 sums (``window_attention_bwd_dq_finish_kernel``), and the bias gradient summed over
the windows sharing a tile of B + M (``window_attention_bwd_dbias_kernel``).
"""
import triton
import triton.language as tl

from .backward import load_rbar, load_row_stats, program_block, scale_grad_terms, softmax_backward_tile, store_dq
from .bias_mask_tiles import bias_grad_tile, bias_tile, bias_tile_either, load_mask_regions, mask_kind_launch
from .tiles import LOG2E, head_scale, key_base, load_qk, load_rows, logit_scale_grad, mma, query_base, window_run


@triton.jit(do_not_specialize=["query_windows"])
def window_attention_bwd_dq_kernel(
    qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_info_ptr, logit_scale_ptr,
    seed_ptr,
    dqkv_ptr,
    dscale_partial_ptr,
    scale, dropout_p, num_periods, stats_stride, query_windows,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_dout_b, stride_dout_n, stride_dout_c,
    stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
    stride_bias_w, stride_bias_h, stride_bias_i, stride_bias_j,
    stride_mask_w, stride_mask_i, stride_mask_j,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
    SCALE_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASK_REGIONS: tl.constexpr, FROM_REGIONS: tl.constexpr,
    GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (B_ * H * query blocks,). dQ of one query block, looping over key blocks;
    also the block's share of d(logit_scale), written to dscale_partial[b, h, block].
    Built and launched once per mask kind with MASK_REGIONS, as the dkdv kernel is.
    GLOBAL_QUERY: the queries read from q_ptr (``tiles.query_base``), dQ still per window."""
    bh, b, h, rows = program_block(H, N, BLOCK_M)
    pid = tl.program_id(0)
    w = b % num_periods
    bias_ptr += w.to(tl.int64) * stride_bias_w  # the bias of mask window w (``bias_mask.streamed_bias``)
    dims = tl.arange(0, BLOCK_D)
    s = head_scale(logit_scale_ptr, h, scale, COSINE)
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    run, mask_value = mask_kind_launch(mask_info_ptr, MASK_REGIONS, FROM_REGIONS)
    if run:
        q_base, q_stride_n = query_base(qkv_ptr, q_ptr, b, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n,
                                        stride_qkv_h, query_windows, GLOBAL_QUERY)
        k_base = key_base(qkv_ptr, b, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
        v_base = k_base + stride_qkv_p
        q_in, q_lowp, q_inv, q_norm = load_qk(q_base, rows, dims, q_stride_n, stride_qkv_d, N, D, COSINE)
        do = load_rows(dout_ptr + b * stride_dout_b + (h * D) * stride_dout_c, rows, dims,
                       stride_dout_n, stride_dout_c, N, D)
        row_max, row_inv_sum, delta = load_row_stats(stats_ptr, delta_ptr, bh, rows, stats_stride, N)
        dq_acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        dscale_rows = tl.zeros((BLOCK_M,), tl.float32)
        if SCALE_GRAD:
            rbar = load_rbar(stats_ptr, bh, rows, stats_stride, N)
        for start_n in range(0, N, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k_in, k_lowp, k_inv, k_norm = load_qk(k_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D, COSINE)
            v = load_rows(v_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D)
            bias_mask = bias_tile(bias_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
                                  stride_bias_h, stride_bias_i, stride_bias_j,
                                  stride_mask_w, stride_mask_i, stride_mask_j,
                                  N, BIAS, 0.0, HAS_MASK, BLOCK_M, BLOCK_N, FROM_REGIONS)
            p, p_v, ds, key_scaled = softmax_backward_tile(q_in, q_inv, k_in, k_inv, v, do, row_max, row_inv_sum,
                                                           delta, bias_mask, s * LOG2E, seed, bh, rows, cols,
                                                           dropout_p, N, COSINE, FP32_DOT, False, HAS_DROPOUT)
            dq_acc = mma(ds.to(k_lowp.dtype), k_lowp, dq_acc, FP32_DOT)
            if SCALE_GRAD:
                dscale_rows += scale_grad_terms(ds, key_scaled, q_inv, rbar)

        store_dq(dq_acc, s, q_in, q_inv, q_norm, dqkv_ptr + b * stride_dqkv_b + h * stride_dqkv_h, rows, dims,
                 stride_dqkv_n, stride_dqkv_d, N, D, COSINE)
        if SCALE_GRAD:
            tl.store(dscale_partial_ptr + pid, logit_scale_grad(tl.sum(dscale_rows, 0), s, logit_scale_ptr, h))


@triton.jit(do_not_specialize=["query_windows"])
def window_attention_bwd_dq_finish_kernel(
    qkv_ptr, q_ptr, logit_scale_ptr, dq_acc_ptr, dqkv_ptr,
    scale, query_windows,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    COSINE: tl.constexpr, GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (B_ * H * query blocks,). dQ of one query block from what the dkdv kernel added
    up in dq_acc with DQ_ATOMIC: times the scale, through the normalization, cast."""
    bh, b, h, rows = program_block(H, N, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    s = head_scale(logit_scale_ptr, h, scale, COSINE)
    q_base, q_stride_n = query_base(qkv_ptr, q_ptr, b, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n,
                                    stride_qkv_h, query_windows, GLOBAL_QUERY)
    q_in, q_lowp, q_inv, q_norm = load_qk(q_base, rows, dims, q_stride_n, stride_qkv_d, N, D, COSINE)
    dq_acc = load_rows(dq_acc_ptr + bh * N * D, rows, dims, D, 1, N, D)
    store_dq(dq_acc, s, q_in, q_inv, q_norm, dqkv_ptr + b * stride_dqkv_b + h * stride_dqkv_h, rows, dims,
             stride_dqkv_n, stride_dqkv_d, N, D, COSINE)


@triton.jit(do_not_specialize=["num_periods", "windows_per_period", "windows_per_program", "query_windows"])
def window_attention_bwd_dbias_kernel(
    qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_info_ptr, logit_scale_ptr,
    seed_ptr,
    dbias_partial_ptr,
    scale, dropout_p, stats_stride,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_dout_b, stride_dout_n, stride_dout_c,
    stride_bias_w, stride_bias_h, stride_bias_i, stride_bias_j,
    stride_mask_w, stride_mask_i, stride_mask_j,
    num_periods, windows_per_period, windows_per_program, query_windows,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, MASK_REGIONS: tl.constexpr, ATOMIC_SUM: tl.constexpr,
    GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (key blocks * query blocks * H * nW * window chunks,). Sum of dZ over a run
    of windows sharing (head, mask window) for one tile: written to
    dbias_partial[group, h, rows, cols], or with ATOMIC_SUM added to dbias_partial[0, h,
    rows, cols] (zeroed) with atomic adds, nW * chunks of them per address: the (nW *
    chunks, H, N, N) partials and their sum (H200, window 24: 85 MB, 30 us) are then not
    needed."""
    NUM_M_BLOCKS: tl.constexpr = (N + BLOCK_M - 1) // BLOCK_M
    NUM_N_BLOCKS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    n_block = pid % NUM_N_BLOCKS
    rest = pid // NUM_N_BLOCKS
    m_block = rest % NUM_M_BLOCKS
    rest = rest // NUM_M_BLOCKS
    h = rest % H
    group = (rest // H).to(tl.int64)
    w, first, last = window_run(group, num_periods, windows_per_period, windows_per_program)
    bias_ptr += w.to(tl.int64) * stride_bias_w  # the bias of mask window w (``bias_mask.streamed_bias``)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    logit_scale2 = head_scale(logit_scale_ptr, h, scale, COSINE) * LOG2E
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    mask_structured, mask_value = load_mask_regions(mask_info_ptr, MASK_REGIONS)
    bias_mask = bias_tile_either(
        bias_ptr, mask_ptr, regions_ptr, mask_structured, mask_value, h, w, rows, cols, stride_bias_h,
        stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j, N, BIAS, HAS_MASK, BLOCK_M,
        BLOCK_N)
    dbias_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # The row statistics feed no product here (dZ only adds up), so the pipeliner does not
    # fetch them ahead as it does q, k, v and dO: they are loaded one window ahead by hand
    # (H200, window 16, ncu: waits on them were a fifth of this kernel's stall samples).
    next_b = (w + tl.minimum(first, windows_per_period - 1) * num_periods).to(tl.int64)
    row_max_next, row_inv_sum_next, delta_next = load_row_stats(stats_ptr, delta_ptr, next_b * H + h, rows,
                                                                stats_stride, N)
    for window in range(first, last):
        b = (w + window * num_periods).to(tl.int64)
        bh = b * H + h
        row_max, row_inv_sum, delta = row_max_next, row_inv_sum_next, delta_next
        next_b = (w + tl.minimum(window + 1, last - 1) * num_periods).to(tl.int64)
        row_max_next, row_inv_sum_next, delta_next = load_row_stats(stats_ptr, delta_ptr, next_b * H + h, rows,
                                                                    stats_stride, N)
        q_base, q_stride_n = query_base(qkv_ptr, q_ptr, b, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n,
                                        stride_qkv_h, query_windows, GLOBAL_QUERY)
        k_base = key_base(qkv_ptr, b, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
        v_base = k_base + stride_qkv_p
        q_in, q_lowp, q_inv, q_norm = load_qk(q_base, rows, dims, q_stride_n, stride_qkv_d, N, D, COSINE)
        k_in, k_lowp, k_inv, k_norm = load_qk(k_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D, COSINE)
        v = load_rows(v_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D)
        do = load_rows(dout_ptr + b * stride_dout_b + (h * D) * stride_dout_c, rows, dims,
                       stride_dout_n, stride_dout_c, N, D)
        p, p_v, ds, _ = softmax_backward_tile(q_in, q_inv, k_in, k_inv, v, do, row_max, row_inv_sum, delta,
                                              bias_mask, logit_scale2, seed, bh, rows, cols, dropout_p, N,
                                              COSINE, FP32_DOT, False, HAS_DROPOUT)
        dbias_acc += bias_grad_tile(ds, BIAS)

    inside = (rows[:, None] < N) & (cols[None, :] < N)
    if ATOMIC_SUM:
        tl.atomic_add(dbias_partial_ptr + (h * N + rows[:, None]) * N + cols[None, :], dbias_acc, mask=inside,
                      sem="relaxed")
    else:
        tl.store(dbias_partial_ptr + ((group * H + h) * N + rows[:, None]) * N + cols[None, :], dbias_acc,
                 mask=inside)
