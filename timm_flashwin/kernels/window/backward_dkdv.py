"""Backward kernels of windows larger than one tile (``backward``'s docstring has the
math): ``window_attention_bwd_delta_kernel`` (rowsum(dO * O), and zeroes the atomic sums),
then ``window_attention_bwd_dkdv_kernel`` over key blocks, which may also add dQ and the
bias gradient with atomics (``config.LaunchConfig``).
"""
import triton
import triton.language as tl

from .backward import input_grad, load_rbar, load_row_stats, program_block, scale_grad_terms, softmax_backward_tile
from .bias_mask_tiles import bias_grad_tile, bias_tile, mask_kind_launch, window_in_one_region
from .tiles import (LOG2E, head_scale, key_base, load_qk, load_rows, logit_scale_grad, mma, query_base, row_norms,
                    store_rows, window_run)


@triton.jit
def zero_run(ptr, start, count, numel):
    """Zeroes the fp32 elements ptr[start : start + count] that lie below ``numel``."""
    for offset in range(0, count, 128):
        idx = offset + tl.arange(0, 128)
        tl.store(ptr + start + idx, tl.zeros((128,), tl.float32), mask=(idx < count) & (start + idx < numel))


@triton.jit(do_not_specialize=["sums_numel", "sums_per_program"])
def window_attention_bwd_delta_kernel(
    out_ptr, dout_ptr, delta_ptr, dq_acc_ptr, sums_ptr, sums_numel, sums_per_program, scale_sums_ptr,
    stride_out_b, stride_out_n, stride_out_c,
    stride_dout_b, stride_dout_n, stride_dout_c,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, ZERO_SUMS: tl.constexpr, ZERO_SCALE_SUMS: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO * O (fp32), for the multi-block path. With DQ_ATOMIC it
    also zeroes the same rows of the buffer the dkdv kernel adds dQ into (B_ * H, N, D),
    with ZERO_SUMS its run of ``sums_per_program`` elements of the fp32 buffer ``sums``
    (``sums_numel`` elements) that the bias gradient is added into with atomic adds, and
    with ZERO_SCALE_SUMS (program 0) the (H,) fp32 sums of d(logit_scale): in the same
    pass, not fill kernels of their own."""
    if ZERO_SCALE_SUMS:
        if tl.program_id(0) == 0:
            zero_run(scale_sums_ptr, 0, H, H)
    if ZERO_SUMS:
        zero_run(sums_ptr, tl.program_id(0).to(tl.int64) * sums_per_program, sums_per_program, sums_numel)
    bh, b, h, rows = program_block(H, N, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    o = load_rows(out_ptr + b * stride_out_b + (h * D) * stride_out_c, rows, dims,
                  stride_out_n, stride_out_c, N, D).to(tl.float32)
    do = load_rows(dout_ptr + b * stride_dout_b + (h * D) * stride_dout_c, rows, dims,
                   stride_dout_n, stride_dout_c, N, D).to(tl.float32)
    tl.store(delta_ptr + bh * N + rows, tl.sum(o * do, 1), mask=rows < N)
    if DQ_ATOMIC:
        acc_ptrs = dq_acc_ptr + (bh * N + rows[:, None]) * D + dims[None, :]
        tl.store(acc_ptrs, tl.zeros((BLOCK_M, BLOCK_D), tl.float32), mask=(rows[:, None] < N) & (dims[None, :] < D))


@triton.jit(do_not_specialize=["num_periods", "windows_per_period", "windows_per_program", "query_windows"])
def window_attention_bwd_dkdv_kernel(
    qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_info_ptr, logit_scale_ptr,
    seed_ptr,
    dqkv_ptr, dq_acc_ptr, dscale_sums_ptr, dbias_slots_ptr,
    scale, dropout_p, stats_stride, num_slots,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_dout_b, stride_dout_n, stride_dout_c,
    stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
    stride_bias_w, stride_bias_h, stride_bias_i, stride_bias_j,
    stride_mask_w, stride_mask_i, stride_mask_j,
    num_periods, windows_per_period, windows_per_program, query_windows,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, MASK_REGIONS: tl.constexpr, DQ_ATOMIC: tl.constexpr, SCALE_GRAD: tl.constexpr,
    DBIAS_ATOMIC: tl.constexpr, FROM_REGIONS: tl.constexpr, ONE_REGION_LOOP: tl.constexpr,
    FLAT_LOOP: tl.constexpr, GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (key blocks * H * nW * window chunks,). dK, dV of one key block of head h for a
    run of windows sharing a mask window (``dkdv_windows``), looping over query blocks.

    DQ_ATOMIC: also adds each tile's dZ K^ to dq_acc (B_ * H, N, D) fp32 with atomic adds
    (the key blocks of a window run as neighbouring programs, so a window's adds meet in L2
    while it is there) and, with SCALE_GRAD, the program's share of d(logit_scale)
    (``scale_grad_terms``) to dscale_sums[h] (H,) fp32 (zeroed by the delta kernel): the
    dq kernel, which would compute every tile of P once more, is then not needed, nor a
    reduction of per-program partials (H200, cosine f+b, 3 alternated rounds: window 16
    511.4 -> 504.4 us, 12 454.7 -> 450.8, 24 1475.2 -> 1469.8).

    DBIAS_ATOMIC: also adds each tile's dZ to dbias_slots[b % num_slots, h] (num_slots,
    H, N, N) fp32 with atomic adds, for the bias gradient (the slots summed afterwards),
    instead of a dbias kernel that computes every tile of P once more. More slots spread
    the adds of windows in flight together, but past L2's size they cost more than they
    save (config.backward_config: one slot, cosine only).

    With MASK_REGIONS the launcher launches this kernel twice, FROM_REGIONS True and False,
    as it does the forward: each build serves one kind of mask (``bias_mask_tiles.add_mask``), and the
    programs of the launch whose kind the mask is not return at once. The loop then holds
    no branch, and its bias tile and region ids are fetched ahead by the pipeliner, as q
    and dO are (H200, window 16, ncu: a third of the kernel's stall samples were waits on
    those loads, made in the mask kind's branch at the top of each tile, and on rbar,
    which is now loaded an iteration ahead).

    ONE_REGION_LOOP: the work (``dkdv_windows``) is built twice, with and without the
    mask, and a program whose mask window is one region takes the copy without it
    (``bias_mask_tiles.window_in_one_region``; config.backward_config says where).

    FLAT_LOOP: one loop over (window, query block) steps (``dkdv_windows``).

    GLOBAL_QUERY: the queries read from q_ptr, as the forward reads them (``tiles.query_base``)."""
    NUM_KEY_BLOCKS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    rest = pid // NUM_KEY_BLOCKS
    h = rest % H
    w, first, last = window_run(rest // H, num_periods, windows_per_period, windows_per_program)
    bias_ptr += w.to(tl.int64) * stride_bias_w  # the bias of mask window w (``bias_mask.streamed_bias``)
    cols = (pid % NUM_KEY_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    s = head_scale(logit_scale_ptr, h, scale, COSINE)
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    run, mask_value = mask_kind_launch(mask_info_ptr, MASK_REGIONS, FROM_REGIONS)
    if run:  # with ONE_REGION_LOOP, windows of one region run a copy of the loop built without a mask
        if window_in_one_region(mask_info_ptr, w, FROM_REGIONS, ONE_REGION_LOOP):
            dscale = dkdv_windows(
                qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
                dqkv_ptr, dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, h, w, first, last,
                num_periods, query_windows, cols, dims,
                stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
                stride_dout_b, stride_dout_n, stride_dout_c,
                stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
                stride_bias_h, stride_bias_i, stride_bias_j,
                stride_mask_w, stride_mask_i, stride_mask_j,
                H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, False, COSINE, FP32_DOT, HAS_DROPOUT,
                DQ_ATOMIC, SCALE_GRAD, DBIAS_ATOMIC, FROM_REGIONS, FLAT_LOOP, GLOBAL_QUERY)
        else:
            dscale = dkdv_windows(
                qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
                dqkv_ptr, dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, h, w, first, last,
                num_periods, query_windows, cols, dims,
                stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
                stride_dout_b, stride_dout_n, stride_dout_c,
                stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
                stride_bias_h, stride_bias_i, stride_bias_j,
                stride_mask_w, stride_mask_i, stride_mask_j,
                H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, HAS_MASK, COSINE, FP32_DOT, HAS_DROPOUT,
                DQ_ATOMIC, SCALE_GRAD, DBIAS_ATOMIC, FROM_REGIONS, FLAT_LOOP, GLOBAL_QUERY)
        if SCALE_GRAD:
            tl.atomic_add(dscale_sums_ptr + h, logit_scale_grad(dscale, s, logit_scale_ptr, h), sem="relaxed")


@triton.jit
def dkdv_windows(qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
                 dqkv_ptr, dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, h, w, first, last,
                 num_periods, query_windows, cols, dims,
                 stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
                 stride_dout_b, stride_dout_n, stride_dout_c,
                 stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
                 stride_bias_h, stride_bias_i, stride_bias_j,
                 stride_mask_w, stride_mask_i, stride_mask_j,
                 H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, DQ_ATOMIC: tl.constexpr, SCALE_GRAD: tl.constexpr,
                 DBIAS_ATOMIC: tl.constexpr, FROM_REGIONS: tl.constexpr,
                 FLAT_LOOP: tl.constexpr, GLOBAL_QUERY: tl.constexpr):
    """The dkdv kernel's work: dK, dV of the key block ``cols`` of head h (head scale ``s``)
    for windows w + nW * [first, last) (the mask window's); HAS_MASK False for a window of one region. Returns
    the sum of the scale-gradient terms (``scale_grad_terms``) over its tiles.

    FLAT_LOOP: one loop over (window, query block) steps, loading the key block's k and v
    at every step, each window's first step starting its sums afresh and its last storing
    them; else one window (the launcher gives each program one), k and v loaded once. The
    pipeliner fetches loads ahead within a loop only (as in the forward, ``forward_windows``):
    the flat loop fetches a window's first blocks while the previous one ends."""
    NUM_Q_BLOCKS: tl.constexpr = (N + BLOCK_M - 1) // BLOCK_M
    dscale = 0.0
    dk_acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if FLAT_LOOP:
        num_steps = (last - first) * NUM_Q_BLOCKS
        if SCALE_GRAD:
            rbar_next = load_rbar(stats_ptr, (w + first * num_periods).to(tl.int64) * H + h, tl.arange(0, BLOCK_M),
                                  stats_stride, N)
        k_inv = tl.zeros((BLOCK_N,), tl.float32)
        k_norm = tl.zeros((BLOCK_N,), tl.float32)
        for step in range(0, num_steps):
            window = first + step // NUM_Q_BLOCKS
            start_m = (step % NUM_Q_BLOCKS) * BLOCK_M
            b = (w + window * num_periods).to(tl.int64)
            k_base = key_base(qkv_ptr, b, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
            k_in = load_rows(k_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D)
            v = load_rows(k_base + stride_qkv_p, cols, dims, stride_qkv_n, stride_qkv_d, N, D)
            # a window's first query block starts its sums afresh: selects, not products with
            # 0, so that a previous window's NaN stays there (H200, window 12 cosine backward:
            # 339.9 us, against 368.7 with new zeros after the last block's store, another start)
            first_block = start_m == 0
            dk_acc = tl.where(first_block, 0.0, dk_acc)
            dv_acc = tl.where(first_block, 0.0, dv_acc)
            if COSINE:
                if first_block:  # the key block's norms, once per window
                    k_norm, k_inv = row_norms(k_in)
            else:
                k_inv = k_norm + 1.0
            rbar = 0.0
            if SCALE_GRAD:  # this step's rbar, loaded a step ahead: nothing else waits on it
                rbar = rbar_next
                following = tl.minimum(step + 1, num_steps - 1)
                rbar_next = load_rbar(stats_ptr, (w + (first + following // NUM_Q_BLOCKS) * num_periods).to(tl.int64)
                                      * H + h, (following % NUM_Q_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M),
                                      stats_stride, N)
            dk_acc, dv_acc, dscale_tile = dkdv_tile(
                qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
                dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, b, h, w, query_windows,
                start_m + tl.arange(0, BLOCK_M), cols, dims, k_in, k_in, k_inv, v, rbar, dk_acc, dv_acc,
                stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
                stride_dout_b, stride_dout_n, stride_dout_c,
                stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, HAS_MASK, COSINE, FP32_DOT, HAS_DROPOUT,
                DQ_ATOMIC, SCALE_GRAD, DBIAS_ATOMIC, FROM_REGIONS, COSINE, GLOBAL_QUERY)
            dscale += dscale_tile
            if start_m + BLOCK_M >= N:  # the window's last query block
                store_dkdv(dk_acc, dv_acc, s, k_in, k_inv, k_norm, dqkv_ptr, b, h, cols, dims,
                           stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d, H, N, D, COSINE)
    else:  # one window per program (the launcher's split)
        b = (w + first * num_periods).to(tl.int64)
        k_base = key_base(qkv_ptr, b, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
        k_in, k_lowp, k_inv, k_norm = load_qk(k_base, cols, dims, stride_qkv_n, stride_qkv_d, N, D, COSINE)
        v = load_rows(k_base + stride_qkv_p, cols, dims, stride_qkv_n, stride_qkv_d, N, D)
        if SCALE_GRAD:
            rbar_next = load_rbar(stats_ptr, b * H + h, tl.arange(0, BLOCK_M), stats_stride, N)
        for start_m in range(0, N, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            rbar = 0.0
            if SCALE_GRAD:  # this block's rbar, loaded an iteration ahead: nothing else waits on it
                rbar = rbar_next
                rbar_next = load_rbar(stats_ptr, b * H + h, rows + BLOCK_M, stats_stride, N)
            dk_acc, dv_acc, dscale_tile = dkdv_tile(
                qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
                dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, b, h, w, query_windows,
                rows, cols, dims, k_in, k_lowp, k_inv, v, rbar, dk_acc, dv_acc,
                stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
                stride_dout_b, stride_dout_n, stride_dout_c,
                stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, HAS_MASK, COSINE, FP32_DOT, HAS_DROPOUT,
                DQ_ATOMIC, SCALE_GRAD, DBIAS_ATOMIC, FROM_REGIONS, False, GLOBAL_QUERY)
            dscale += dscale_tile
        store_dkdv(dk_acc, dv_acc, s, k_in, k_inv, k_norm, dqkv_ptr, b, h, cols, dims,
                   stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d, H, N, D, COSINE)
    return dscale


@triton.jit
def dkdv_tile(qkv_ptr, q_ptr, dout_ptr, stats_ptr, delta_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, seed, s,
              dq_acc_ptr, dbias_slots_ptr, dropout_p, stats_stride, num_slots, b, h, w, query_windows,
              rows, cols, dims, k_in, k_lowp, k_inv, v, rbar, dk_acc, dv_acc,
              stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
              stride_dout_b, stride_dout_n, stride_dout_c,
              stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
              H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, DQ_ATOMIC: tl.constexpr, SCALE_GRAD: tl.constexpr,
              DBIAS_ATOMIC: tl.constexpr, FROM_REGIONS: tl.constexpr,
              RAW_K: tl.constexpr, GLOBAL_QUERY: tl.constexpr):
    """One (query block ``rows``, key block ``cols``) tile of window b, head h: (dk_acc, dv_acc,
    the tile's scale-gradient terms); with DQ_ATOMIC the tile's dQ and with DBIAS_ATOMIC
    its dZ added with atomic adds.

    k_lowp is the operand of dQ's product (``load_qk``); with RAW_K (cosine) it is k as
    loaded, and dZ K^ = (dZ diag(1 / max(||k||, eps))) K: in the flat loop, whose unit rows of
    k would stay in registers across a window's steps (H200, f+b us: window 16 541.8 ->
    522.0, 12 474.1 -> 460.3; window 24's nested loop, one window per program, 1482.7 with
    unit rows against 1500.4 without)."""
    bh = b * H + h
    q_base, q_stride_n = query_base(qkv_ptr, q_ptr, b, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n,
                                    stride_qkv_h, query_windows, GLOBAL_QUERY)
    q_in = load_rows(q_base, rows, dims, q_stride_n, stride_qkv_d, N, D)
    do = load_rows(dout_ptr + b * stride_dout_b + (h * D) * stride_dout_c, rows, dims, stride_dout_n, stride_dout_c,
                   N, D)
    row_max, row_inv_sum, delta = load_row_stats(stats_ptr, delta_ptr, bh, rows, stats_stride, N)
    # cosine: the rows' inverse norms as the forward computed them (stats[3]), q itself
    # only an operand of the products (the rows' norms and unit rows would take registers
    # and shared memory at every tile)
    q_inv = tl.load(stats_ptr + 3 * stats_stride + bh * N + rows, mask=rows < N, other=0.0) if COSINE else 1.0
    bias_mask = bias_tile(bias_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
                          stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                          N, BIAS, 0.0, HAS_MASK, BLOCK_M, BLOCK_N, FROM_REGIONS)
    p, p_v, ds, key_scaled = softmax_backward_tile(q_in, q_inv, k_in, k_inv, v, do, row_max, row_inv_sum, delta,
                                                   bias_mask, s * LOG2E, seed, bh, rows, cols, dropout_p, N,
                                                   COSINE, FP32_DOT, False, HAS_DROPOUT)
    ds_lowp = ds.to(q_in.dtype)
    dv_acc = mma(tl.trans(p_v.to(do.dtype)), do, dv_acc, FP32_DOT)
    if COSINE:  # dZ^T Q^ = (diag(1 / max(||q||, eps)) dZ)^T Q
        dk_acc = mma(tl.trans((ds * q_inv[:, None]).to(q_in.dtype)), q_in, dk_acc, FP32_DOT)
    else:
        dk_acc = mma(tl.trans(ds_lowp), q_in, dk_acc, FP32_DOT)
    if DQ_ATOMIC:
        ds_for_dq = (ds * k_inv[None, :]).to(q_in.dtype) if RAW_K else ds_lowp
        dq_part = mma(ds_for_dq, k_lowp, tl.zeros((BLOCK_M, BLOCK_D), tl.float32), FP32_DOT)
        tl.atomic_add(dq_acc_ptr + (bh * N + rows[:, None]) * D + dims[None, :], dq_part,
                      mask=(rows[:, None] < N) & (dims[None, :] < D), sem="relaxed")
    dscale = 0.0
    if SCALE_GRAD:
        dscale = tl.sum(scale_grad_terms(ds, key_scaled, q_inv, rbar), 0)
    if DBIAS_ATOMIC:
        slot = b % num_slots
        tl.atomic_add(dbias_slots_ptr + ((slot * H + h) * N + rows[:, None]) * N + cols[None, :],
                      bias_grad_tile(ds, BIAS),
                      mask=(rows[:, None] < N) & (cols[None, :] < N), sem="relaxed")
    return dk_acc, dv_acc, dscale


@triton.jit
def store_dkdv(dk_acc, dv_acc, s, k_in, k_inv, k_norm, dqkv_ptr, b, h, cols, dims,
               stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
               H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
               COSINE: tl.constexpr):
    """dK (from dk_acc = dZ^T Q^, ``input_grad``) and dV of key block ``cols`` of window b, head h."""
    dk = input_grad(dk_acc, s, k_in, k_inv, k_norm, COSINE)
    dk_base = dqkv_ptr + b * stride_dqkv_b + stride_dqkv_p + h * stride_dqkv_h
    store_rows(dk_base, dk, cols, dims, stride_dqkv_n, stride_dqkv_d, N, D)
    store_rows(dk_base + stride_dqkv_p, dv_acc, cols, dims, stride_dqkv_n, stride_dqkv_d, N, D)
