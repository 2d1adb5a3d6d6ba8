"""Forward kernel: O = softmax(S + B[h] + M[b mod nW]) V for every window b and head h.

One program owns one (query block, head h, mask window w) and a run of windows
b = w, w + nW, w + 2 nW, ... that all share the same bias B[h] and mask M[w]. When the
whole window fits one key block (N <= BLOCK_N), that bias+mask tile is read once per
program instead of once per window: what remains per window is reading q, k, v and
writing o. Larger windows stream key blocks with the online softmax of FlashAttention.
With attention dropout, the normalizer sums the undropped probabilities and only their
product with V is dropped (O = (P * keep / (1 - p)) V, as timm's attn_drop applies it).
"""
import triton
import triton.language as tl

from .bias_mask_tiles import TABLE_BIAS, bias_tile, mask_kind_launch, window_in_one_region
from .tiles import (LOG2E, dropout_factor, head_scale, key_base, load_window_qk, load_window_rows, logits_tile, mma,
                    query_base, row_norms, store_window_rows, window_rows, window_run)


@triton.jit(do_not_specialize=["num_periods", "windows_per_period", "windows_per_program", "map_windows",
                             "windows_x", "map_height", "map_width", "shift_h", "shift_w", "query_windows"])
def window_attention_fwd_kernel(
    qkv_ptr, q_ptr, out_ptr, stats_ptr, bias_ptr, bias_index_ptr, mask_ptr, regions_ptr, mask_info_ptr,
    logit_scale_ptr, seed_ptr, scale, dropout_p,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_out_b, stride_out_n, stride_out_c,
    stride_bias_w, stride_bias_h, stride_bias_i, stride_bias_j,
    stride_mask_w, stride_mask_i, stride_mask_j,
    num_periods, windows_per_period, windows_per_program,
    map_windows, windows_x, map_height, map_width, shift_h, shift_w, query_windows,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr,
    FP32_DOT: tl.constexpr, STORE_STATS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    MASK_REGIONS: tl.constexpr, FROM_REGIONS: tl.constexpr, ONE_REGION_LOOP: tl.constexpr,
    FLAT_LOOP: tl.constexpr, MAPPED: tl.constexpr, WINDOW_W: tl.constexpr, BIAS_SIGMOID: tl.constexpr,
    GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (query blocks * H * nW * window chunks,). Writes out (B_, N, H*D) (MAPPED: the
    feature-map layout, (B, H*W, H*D) as qkv, windows WINDOW_W tokens wide, ``tiles.window_rows``)
    and, with GLOBAL_QUERY, the queries read from q_ptr (an image's, shared by its windows,
    ``tiles.query_base``; qkv then holds the keys and values, (B_, N, 2, H, D)); the bias B of
    kind BIAS (``bias_mask_tiles.bias_tile``), with TABLE_BIAS (windows of one key block) read
    from its table (T, H) at bias_ptr, rows stride_bias_i apart, heads stride_bias_h, through
    the (N, N) index at bias_index_ptr, BIAS_SIGMOID its sigmoid scale or 0; and, with
    STORE_STATS, the softmax row statistics the multi-block backward needs: stats[0] the
    row max of the log2 logits, stats[1] 1 / sum(exp2(logits - max)), each (B_, H, N),
    and for cosine attention stats[2] the rows' P-weighted mean score
    rbar_i = sum_j P_ij R_ij (R = Q^ K^^T, undropped P) divided by q_inv_i, which centers
    the logit-scale gradient (``backward.scale_grad_terms``), and stats[3] q_inv_i, the
    rows' 1 / max(||q_i||, eps) (the dkdv kernel reads them rather than computing them at
    each of its tiles).
    Two numbers rather than one log-sum-exp: Z - max is exact where Z - lse would carry
    the rounding of lse (~1e-5 relative in P at logits ~100), which the cancelling sum
    of the logit-scale gradient amplifies."""
    NUM_M_BLOCKS: tl.constexpr = (N + BLOCK_M - 1) // BLOCK_M

    pid = tl.program_id(0)
    m_block = pid % NUM_M_BLOCKS
    rest = pid // NUM_M_BLOCKS
    h = rest % H
    w, first, last = window_run(rest // H, num_periods, windows_per_period, windows_per_program)
    bias_ptr += w.to(tl.int64) * stride_bias_w  # the bias of mask window w (``bias_mask.streamed_bias``)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    logit_scale2 = head_scale(logit_scale_ptr, h, scale, COSINE) * LOG2E
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    # With MASK_REGIONS the launcher launches this kernel twice, FROM_REGIONS True and False:
    # each build serves one kind of mask, and only the launch of the kind found runs.
    # Built apart, the kernel for timm's masks stays small enough (62 KB of shared memory
    # against 94 KB, where two tiles per key block set the size of a both-kinds build) to
    # run three programs per SM under a cap of 168 registers (config.forward_config).
    # Measured on an H100, window 24, bf16: V1 620 -> 544 us, cosine 828 -> 712 us.
    # With ONE_REGION_LOOP, windows of one region (9 of timm's 16 shifted windows of 4 x 4) run
    # a copy of the loop built without a mask (``window_in_one_region``).
    run, mask_value = mask_kind_launch(mask_info_ptr, MASK_REGIONS, FROM_REGIONS)
    if run:
        if window_in_one_region(mask_info_ptr, w, FROM_REGIONS, ONE_REGION_LOOP):
            forward_windows(qkv_ptr, q_ptr, out_ptr, stats_ptr, bias_ptr, bias_index_ptr, mask_ptr, regions_ptr,
                            mask_value,
                            seed, logit_scale2, dropout_p, h, w, first, last, rows, cols, dims,
                            stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d,
                            stride_q_b, stride_q_n, query_windows, stride_out_b, stride_out_n, stride_out_c,
                            stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                            num_periods, windows_per_period,
                            map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                            H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, False, COSINE, FP32_DOT, STORE_STATS,
                            HAS_DROPOUT, FROM_REGIONS, FLAT_LOOP, MAPPED, WINDOW_W, BIAS_SIGMOID, GLOBAL_QUERY)
        else:
            forward_windows(qkv_ptr, q_ptr, out_ptr, stats_ptr, bias_ptr, bias_index_ptr, mask_ptr, regions_ptr,
                            mask_value,
                            seed, logit_scale2, dropout_p, h, w, first, last, rows, cols, dims,
                            stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d,
                            stride_q_b, stride_q_n, query_windows, stride_out_b, stride_out_n, stride_out_c,
                            stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                            num_periods, windows_per_period,
                            map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                            H, N, D, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, HAS_MASK, COSINE, FP32_DOT, STORE_STATS,
                            HAS_DROPOUT, FROM_REGIONS, FLAT_LOOP, MAPPED, WINDOW_W, BIAS_SIGMOID, GLOBAL_QUERY)


@triton.jit
def forward_windows(qkv_ptr, q_ptr, out_ptr, stats_ptr, bias_ptr, bias_index_ptr, mask_ptr, regions_ptr, mask_value,
                    seed,
                    logit_scale2, dropout_p, h, w, first, last, rows, cols, dims,
                    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d,
                    stride_q_b, stride_q_n, query_windows, stride_out_b, stride_out_n, stride_out_c,
                    stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                    num_periods, windows_per_period,
                    map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
                    STORE_STATS: tl.constexpr, HAS_DROPOUT: tl.constexpr, FROM_REGIONS: tl.constexpr,
                    FLAT_LOOP: tl.constexpr, MAPPED: tl.constexpr, WINDOW_W: tl.constexpr,
                    BIAS_SIGMOID: tl.constexpr, GLOBAL_QUERY: tl.constexpr):
    """The forward of one program's query block over its run of windows.

    FLAT_LOOP: one loop over (window, key block) steps, each window's last step storing its
    rows and starting the next window's softmax afresh; else a loop over windows around a
    loop over key blocks. The pipeliner fetches loads ahead within a loop only: a loop of
    its own per window waits for the window's first blocks at every start, the flat loop
    fetches them while the previous window ends, but loads the q tile at every step
    (config.LaunchConfig.flat_loop says where each is faster)."""
    NUM_KEY_BLOCKS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    tl.static_assert(NUM_KEY_BLOCKS == 1 or BIAS != TABLE_BIAS,
                     "the bias is read from its table in one-tile windows only")
    if NUM_KEY_BLOCKS == 1:  # one bias+mask tile for all the program's windows
        bias_mask = bias_tile(bias_ptr, bias_index_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
                              stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                              N, BIAS, BIAS_SIGMOID, HAS_MASK, BLOCK_M, BLOCK_N, FROM_REGIONS)
    m_i, l_i, r_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    q_inv = tl.zeros((BLOCK_M,), tl.float32)
    q_scale = q_inv
    if FLAT_LOOP:
        for step in range(0, (last - first) * NUM_KEY_BLOCKS):
            window = first + step // NUM_KEY_BLOCKS
            start_n = (step % NUM_KEY_BLOCKS) * BLOCK_N
            b = (w + window * num_periods).to(tl.int64)
            image, q_addr = window_rows(b, rows, map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                                        N, WINDOW_W, MAPPED)
            q_base, q_stride_n = query_base(qkv_ptr, q_ptr, image, h, stride_qkv_b, stride_qkv_n, stride_q_b,
                                            stride_q_n, stride_qkv_h, query_windows, GLOBAL_QUERY)
            q_in = load_window_rows(q_base, q_addr, rows, dims, q_stride_n, stride_qkv_d, N, D)
            kv_base = key_base(qkv_ptr, image, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
            if NUM_KEY_BLOCKS > 1:
                bias_mask = bias_tile(bias_ptr, bias_index_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows,
                                      start_n + cols, stride_bias_h, stride_bias_i, stride_bias_j,
                                      stride_mask_w, stride_mask_i, stride_mask_j,
                                      N, BIAS, BIAS_SIGMOID, HAS_MASK, BLOCK_M, BLOCK_N, FROM_REGIONS)
            if COSINE:
                if start_n == 0:  # the rows' norms, once per window
                    q_inv = row_norms(q_in)[1]
                    q_scale = q_inv * logit_scale2
            key_addr = window_rows(b, start_n + cols, map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                                   N, WINDOW_W, MAPPED)[1]
            m_i, l_i, r_i, acc = softmax_step(
                q_in, q_scale, kv_base, m_i, l_i, r_i, acc, bias_mask, seed, logit_scale2, dropout_p, b * H + h,
                rows, start_n + cols, key_addr, dims, stride_qkv_n, stride_qkv_p, stride_qkv_d,
                H, N, D, COSINE, FP32_DOT, STORE_STATS, HAS_DROPOUT, NUM_KEY_BLOCKS == 1)
            if start_n + BLOCK_N >= N:  # the window's last key block: its rows are done
                store_rows_and_stats(out_ptr, stats_ptr, acc, m_i, l_i, r_i, q_inv, b, image, q_addr, h, rows, dims,
                                     stride_out_b, stride_out_n, stride_out_c, num_periods * windows_per_period,
                                     H, N, D, COSINE, STORE_STATS)
                # the next window's softmax starts afresh (new values, not products with 0, so
                # that this window's NaN stays here)
                m_i, l_i, r_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    else:
        for window in range(first, last):
            b = (w + window * num_periods).to(tl.int64)
            image, q_addr = window_rows(b, rows, map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                                        N, WINDOW_W, MAPPED)
            q_base, q_stride_n = query_base(qkv_ptr, q_ptr, image, h, stride_qkv_b, stride_qkv_n, stride_q_b,
                                            stride_q_n, stride_qkv_h, query_windows, GLOBAL_QUERY)
            q_in = load_window_rows(q_base, q_addr, rows, dims, q_stride_n, stride_qkv_d, N, D)
            kv_base = key_base(qkv_ptr, image, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
            if COSINE:
                q_inv = row_norms(q_in)[1]
                q_scale = q_inv * logit_scale2
            m_i, l_i, r_i, acc = softmax_start(BLOCK_M, BLOCK_D)
            for start_n in range(0, N, BLOCK_N):
                if NUM_KEY_BLOCKS > 1:
                    bias_mask = bias_tile(bias_ptr, bias_index_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows,
                                          start_n + cols, stride_bias_h, stride_bias_i, stride_bias_j,
                                          stride_mask_w, stride_mask_i, stride_mask_j,
                                          N, BIAS, BIAS_SIGMOID, HAS_MASK, BLOCK_M, BLOCK_N, FROM_REGIONS)
                key_addr = window_rows(b, start_n + cols, map_windows, windows_x, map_height, map_width, shift_h,
                                       shift_w, N, WINDOW_W, MAPPED)[1]
                m_i, l_i, r_i, acc = softmax_step(
                    q_in, q_scale, kv_base, m_i, l_i, r_i, acc, bias_mask, seed, logit_scale2, dropout_p, b * H + h,
                    rows, start_n + cols, key_addr, dims, stride_qkv_n, stride_qkv_p, stride_qkv_d,
                    H, N, D, COSINE, FP32_DOT, STORE_STATS, HAS_DROPOUT, NUM_KEY_BLOCKS == 1)
            store_rows_and_stats(out_ptr, stats_ptr, acc, m_i, l_i, r_i, q_inv, b, image, q_addr, h, rows, dims,
                                 stride_out_b, stride_out_n, stride_out_c, num_periods * windows_per_period,
                                 H, N, D, COSINE, STORE_STATS)


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax's state before a window's first key block: (row max m = -inf,
    row sum l, r (cosine: sum_j P T, T = R times the row's norm, as l sums P), output sum acc)."""
    return (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32))


@triton.jit
def softmax_step(q_in, q_scale, kv_base, m_i, l_i, r_i, acc, bias_mask, seed, logit_scale2, dropout_p, bh,
                 rows, key_rows, key_addr, dims, stride_qkv_n, stride_qkv_p, stride_qkv_d,
                 H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
                 STORE_STATS: tl.constexpr, HAS_DROPOUT: tl.constexpr, WHOLE_WINDOW: tl.constexpr):
    """One key block of the online softmax of FlashAttention: (m, l, r, acc) updated with the
    keys ``key_rows`` (at the rows ``key_addr``, ``tiles.window_rows``) of the window whose q tile is
    ``q_in``, its keys at ``kv_base`` in qkv and its values stride_qkv_p further; for
    cosine attention q_scale is the rows' inverse norms times the scale (``tiles.row_norms``).

    WHOLE_WINDOW: the block holds all the window's keys, and (m, l, r, acc) are
    ``softmax_start``'s: the plain softmax, without the rescaling of a previous state by
    exp2(-inf) = 0 (a multiply per output element and an exp2 per row fewer; the same
    values)."""
    k_base = kv_base
    v_base = kv_base + stride_qkv_p
    k_in, k_lowp, k_inv, k_norm = load_window_qk(k_base, key_addr, key_rows, dims, stride_qkv_n, stride_qkv_d, N, D,
                                                 COSINE)
    v = load_window_rows(v_base, key_addr, key_rows, dims, stride_qkv_n, stride_qkv_d, N, D)
    # cosine: r sums P T, its rows' factor applied once per window (``store_rows_and_stats``)
    key_scaled, logits = logits_tile(q_in, k_in, k_inv, q_scale, logit_scale2, bias_mask, COSINE, FP32_DOT)
    # A row whose logits so far are all -inf keeps m = -inf; it is shifted by 0 instead so
    # that exp2 gives 0, not NaN, until a finite logit comes. WHOLE_WINDOW takes branches of
    # its own: max(-inf, x) and 0 + x cannot be folded (a NaN x, a signed zero), and in the
    # flat loop (m, l, r) are the loop's values, reset at each window's end; one branch for
    # both cost 4 instructions more per step (sm_90 build, triton 3.6, N = 49: 366 -> 370).
    if WHOLE_WINDOW:
        m_new = tl.max(logits, 1)
    else:
        m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(logits - m_shift[:, None])
    if WHOLE_WINDOW:
        l_i = tl.sum(p, 1)
        if STORE_STATS and COSINE:
            r_i = tl.sum(p * key_scaled, 1)
    else:
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if STORE_STATS and COSINE:
            r_i = r_i * alpha + tl.sum(p * key_scaled, 1)
        acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = p * dropout_factor(seed, bh, rows, key_rows, dropout_p, N)
    acc = mma(p.to(v.dtype), v, acc, FP32_DOT)
    return m_new, l_i, r_i, acc


@triton.jit
def store_rows_and_stats(out_ptr, stats_ptr, acc, m_i, l_i, r_i, q_inv, b, image, addr, h, rows, dims,
                         stride_out_b, stride_out_n, stride_out_c, num_windows,
                         H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, COSINE: tl.constexpr,
                         STORE_STATS: tl.constexpr):
    """Window b's output rows (the rows ``addr`` of image ``image``, ``tiles.window_rows``), and
    with STORE_STATS its softmax statistics (cosine: also the rows' rbar and their inverse
    norms ``q_inv``, for the dkdv kernel), indexed by window."""
    # One reciprocal per row and a multiply per element, not a division per element (the
    # compiler's fp32 division takes four to five instructions). A fully masked row has
    # l = 0 and yields 0 * inf = NaN, as the float64 reference does.
    inv_l = 1.0 / l_i
    out = acc * inv_l[:, None]
    store_window_rows(out_ptr + image * stride_out_b + (h * D) * stride_out_c, out, addr, rows, dims,
                      stride_out_n, stride_out_c, N, D)
    if STORE_STATS:
        stats = stats_ptr + (b * H + h) * N + rows
        tl.store(stats, tl.where(m_i == float("-inf"), 0.0, m_i), mask=rows < N)
        tl.store(stats + num_windows * H * N, inv_l, mask=rows < N)
        if COSINE:
            rbar = tl.where(l_i == 0.0, 0.0, r_i / l_i)  # in units of T (``softmax_step``): rbar_i / q_inv_i
            tl.store(stats + 2 * num_windows * H * N, rbar, mask=rows < N)
            tl.store(stats + 3 * num_windows * H * N, q_inv, mask=rows < N)
