"""Backward kernels. They recompute the probabilities from q, k, bias and mask: windows of
one tile renormalize their rows themselves, larger ones take the row max and 1 / row sum the
forward saved (two numbers rather than a log-sum-exp: ``forward.py`` says why); nothing of
size N x N is kept between passes.

With logits Z = S + B + M and P = softmax(Z):
    dV = P^T dO,   dP = dO V^T,   dZ = P * (dP - rowsum(P * dP)),
    dB[h] = sum over windows of dZ,                      (bias gradient)
    dQ^ = s dZ K^,   dK^ = s dZ^T Q^,   ds = sum dZ * R  with R = Q^ K^^T,
    where s is ``scale`` (V1, Q^ = Q) or the cosine head scale s = exp(min(logit_scale, ln 100));
    for cosine attention dQ and dK then pass through the normalization
    (tiles.normalize_backward), and the kernels write d(logit_scale) = ds * s (0 where the
    clamp is active) partials (tiles.logit_scale_grad).
rowsum(P * dP) equals rowsum(dO * O), which is what the multi-block path precomputes.
With attention dropout (factor F = keep / (1 - p), regenerated from the forward's seed):
    dV = (P F)^T dO,   dP = F * (dO V^T),   and the rest as above; rowsum(dO * O) is
    still rowsum(P * dP).

Two paths, picked by the launcher:

* N fits one tile: ``window_attention_bwd_fused_kernel`` does everything for a run of
  windows sharing (head, mask window); it sums dZ over those windows in registers and
  writes one partial bias gradient per program, summed afterwards by the launcher. It also
  reads and writes the feature-map layout (MAPPED, ``tiles.window_rows``).
* Larger N (``backward_dkdv.py``, ``backward_dq_dbias.py``, which take this file's tile
  helpers): ``delta`` (rowsum(dO * O)), then a ``dkdv`` kernel over key blocks. dQ is
  either added by the ``dkdv`` kernel, tile by tile, into an fp32 buffer with atomic adds
  and finished (scaled, normalized, cast) by ``dq_finish``, or computed by its own ``dq``
  kernel, which recomputes every tile of P once more. The bias gradient is either added by
  the ``dkdv`` kernel into (H, N, N) slots with atomic adds, or computed by a ``dbias``
  kernel that loops over windows sharing a tile of B + M and adds its sums up with atomic
  adds (or writes partials, summed afterwards). The launch
  configuration picks (config.LaunchConfig.dq_atomic, dbias_slots); the cosine scale
  gradient is summed by whichever kernel computes dQ, centred on the forward's rbar.

Atomics are used only outside ``torch.use_deterministic_algorithms(True)``: in that mode
both paths give bit-for-bit reproducible gradients.
"""
import triton
import triton.language as tl

from .bias_mask_tiles import bias_grad_tile, bias_tile
from .tiles import (LOG2E, dropout_factor, head_scale, key_base, load_window_qk, load_window_rows, logit_scale_grad,
                    logits_tile, mma, normalize_backward, query_base, store_rows, store_window_rows, window_rows,
                    window_run)


@triton.jit
def softmax_backward_tile(q_in, q_inv, k_in, k_inv, v, do, row_max, row_inv_sum, delta, bias_mask,
                          logit_scale2, seed, bh, rows, cols, dropout_p, N: tl.constexpr,
                          COSINE: tl.constexpr, FP32_DOT: tl.constexpr, ROW_COMPLETE: tl.constexpr,
                          HAS_DROPOUT: tl.constexpr):
    """Recompute one (query block, key block) tile of window-head ``bh``; returns
    (P, P as applied to V (dropped and rescaled with dropout, else P), dZ, T), fp32.

    q and k come from ``load_qk``; T and the logits from ``logits_tile``, as in the forward:
    Q K^T for V1, and for cosine attention T = R diag(max(||q||, eps)), R = Q^ K^^T =
    diag(q_inv) T (``scale_grad_terms`` takes T and q_inv). P comes from the forward's row
    statistics (row max, 1 / row sum), or, with ROW_COMPLETE (the tile holds whole rows),
    from a softmax over the tile itself, which also gives rowsum(P * dP); the statistics
    and ``delta`` are then ignored.
    """
    key_scaled, logits = logits_tile(q_in, k_in, k_inv, q_inv * logit_scale2, logit_scale2, bias_mask, COSINE,
                                     FP32_DOT)
    if ROW_COMPLETE:
        # A fully masked row: max -inf, shifted by 0, sum 0, P = 0 * inf = NaN as in the
        # reference. One reciprocal per row, not a division per element (the forward's too).
        row_max = tl.max(logits, 1)
        p = tl.exp2(logits - tl.where(row_max == float("-inf"), 0.0, row_max)[:, None])
        p = p * (1.0 / tl.sum(p, 1))[:, None]
    else:
        p = tl.exp2(logits - row_max[:, None]) * row_inv_sum[:, None]
    dp = mma(do, tl.trans(v), tl.zeros(p.shape, tl.float32), FP32_DOT)
    if HAS_DROPOUT:
        keep_scale = dropout_factor(seed, bh, rows, cols, dropout_p, N)
        dp = dp * keep_scale
        p_v = p * keep_scale
    else:
        p_v = p
    if ROW_COMPLETE:
        delta = tl.sum(p * dp, 1)
    ds = p * (dp - delta[:, None])
    return p, p_v, ds, key_scaled


@triton.jit
def program_block(H: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """(bh, b, h, offsets) of a program of a grid (B_ * H * blocks of N,): its window-head
    bh = b * H + h (int64) and the token offsets of its block of BLOCK rows or columns."""
    NUM_BLOCKS: tl.constexpr = (N + BLOCK - 1) // BLOCK
    pid = tl.program_id(0)
    bh = (pid // NUM_BLOCKS).to(tl.int64)
    offsets = (pid % NUM_BLOCKS) * BLOCK + tl.arange(0, BLOCK)
    return bh, bh // H, bh % H, offsets


@triton.jit
def load_row_stats(stats_ptr, delta_ptr, bh, rows, stats_stride, N: tl.constexpr):
    """(row max, 1 / row sum, rowsum(dO * O)) of the rows of (window, head) ``bh``.
    Padded rows read (0, 0, 0), which makes their P and dZ exactly 0."""
    offs = bh * N + rows
    row_max = tl.load(stats_ptr + offs, mask=rows < N, other=0.0)
    row_inv_sum = tl.load(stats_ptr + stats_stride + offs, mask=rows < N, other=0.0)
    delta = tl.load(delta_ptr + offs, mask=rows < N, other=0.0)
    return row_max, row_inv_sum, delta


@triton.jit
def input_grad(dx_acc, s, x_in, x_inv, x_norm, COSINE: tl.constexpr):
    """dQ or dK from dx_acc = dZ K^ (or dZ^T Q^), fp32, and the tile x as loaded: times s, then through the
    normalization for cosine attention."""
    dx = dx_acc * s
    if COSINE:
        dx = normalize_backward(dx, x_in, x_inv, x_norm)
    return dx


@triton.jit
def store_dq(dq_acc, s, q_in, q_inv, q_norm, dq_base, rows, dims, stride_n, stride_c,
             N: tl.constexpr, D: tl.constexpr, COSINE: tl.constexpr):
    """Store dQ of a query block from dq_acc = dZ K^ (fp32, summed over all key blocks)."""
    dq = input_grad(dq_acc, s, q_in, q_inv, q_norm, COSINE)
    store_rows(dq_base, dq, rows, dims, stride_n, stride_c, N, D)


@triton.jit
def scale_grad_terms(ds, key_scaled, q_inv, rbar_t):
    """Per row of a tile, sum_j dZ_ij (R_ij - rbar_i), with rbar_i = sum_j P_ij R_ij the row's
    P-weighted mean score: summed over all tiles, d(head scale). Equal to sum dZ R since
    sum_j dZ_ij = 0, but insensitive to the rounding of delta (rowsum(dO * O) is not
    bit-equal to rowsum(P * dP)), which the cancelling sum of a large logit scale would
    otherwise amplify. From T = diag(1 / q_inv) R (``softmax_backward_tile``) and the
    forward's rbar_t = rbar / q_inv = sum_j P_ij T_ij (``load_rbar``):
    q_inv_i sum_j dZ_ij (T_ij - rbar_t_i); 0 on padded rows (q_inv and rbar_t load 0)."""
    return tl.sum(ds * (key_scaled - rbar_t[:, None]), 1) * q_inv


@triton.jit
def load_rbar(stats_ptr, bh, rows, stats_stride, N: tl.constexpr):
    """The forward's rbar / q_inv (stats[2]) of the rows of window-head ``bh``, 0 on padded
    rows."""
    return tl.load(stats_ptr + 2 * stats_stride + bh * N + rows, mask=rows < N, other=0.0)


@triton.jit(do_not_specialize=["num_periods", "windows_per_period", "windows_per_program", "map_windows",
                             "windows_x", "map_height", "map_width", "shift_h", "shift_w", "query_windows"])
def window_attention_bwd_fused_kernel(
    qkv_ptr, q_ptr, dout_ptr, bias_ptr, bias_index_ptr, mask_ptr, logit_scale_ptr, seed_ptr,
    dqkv_ptr, dbias_partial_ptr, dscale_partial_ptr,
    scale, dropout_p,
    stride_qkv_b, stride_qkv_n, stride_qkv_p, stride_qkv_h, stride_qkv_d, stride_q_b, stride_q_n,
    stride_dout_b, stride_dout_n, stride_dout_c,
    stride_dqkv_b, stride_dqkv_n, stride_dqkv_p, stride_dqkv_h, stride_dqkv_d,
    stride_bias_w, stride_bias_h, stride_bias_i, stride_bias_j,
    stride_mask_w, stride_mask_i, stride_mask_j,
    stride_partial_group,
    num_periods, windows_per_period, windows_per_program,
    map_windows, windows_x, map_height, map_width, shift_h, shift_w, query_windows,
    H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, FP32_DOT: tl.constexpr,
    BIAS_GRAD: tl.constexpr, SCALE_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, MAPPED: tl.constexpr,
    WINDOW_W: tl.constexpr, BIAS_SIGMOID: tl.constexpr, GLOBAL_QUERY: tl.constexpr,
):
    """Grid: (H * nW * window chunks,). One whole window per tile. MAPPED: qkv, dout and dqkv
    in the feature-map layout, windows WINDOW_W tokens wide (``tiles.window_rows``).
    GLOBAL_QUERY: the queries read from q_ptr, as the forward reads them; dqkv (B_, N, 3, H, D)
    still gets each window's dQ (summed over an image's windows by the launcher's caller).
    Each program group (the H programs of one mask window and chunk) writes its partial bias
    gradient (H, N, N) at dbias_partial_ptr and its partial logit-scale gradient (H,) at
    dscale_partial_ptr, both stride_partial_group apart from group to group (the launcher
    lays the two out in one buffer, which one reduction sums).
    BIAS: the bias's kind, read as the forward reads it (``bias_mask_tiles.bias_tile``; a
    table through the index at bias_index_ptr); its gradient is the dense (H, N, N) partial
    sums (``bias_grad_tile``), which the table's gradient kernel sums per table row."""
    pid = tl.program_id(0)
    h = pid % H
    group = (pid // H).to(tl.int64)  # = chunk * num_periods + w
    w, first, last = window_run(group, num_periods, windows_per_period, windows_per_program)
    bias_ptr += w.to(tl.int64) * stride_bias_w  # the bias of mask window w (``bias_mask.streamed_bias``)

    idx = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    s = head_scale(logit_scale_ptr, h, scale, COSINE)
    seed = tl.load(seed_ptr) if HAS_DROPOUT else 0
    bias_mask = bias_tile(bias_ptr, bias_index_ptr, mask_ptr, bias_ptr, 0.0, h, w, idx, idx,
                          stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                          N, BIAS, BIAS_SIGMOID, HAS_MASK, BLOCK_N, BLOCK_N, False)
    dbias_acc = tl.zeros((BLOCK_N, BLOCK_N), tl.float32)
    dscale_acc = tl.zeros((BLOCK_N,), tl.float32)

    for window in range(first, last):
        b = (w + window * num_periods).to(tl.int64)
        image, addr = window_rows(b, idx, map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                                  N, WINDOW_W, MAPPED)
        q_base, q_stride_n = query_base(qkv_ptr, q_ptr, image, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n,
                                        stride_qkv_h, query_windows, GLOBAL_QUERY)
        k_base = key_base(qkv_ptr, image, h, stride_qkv_b, stride_qkv_p, stride_qkv_h, GLOBAL_QUERY)
        v_base = k_base + stride_qkv_p
        q_in, q_lowp, q_inv, q_norm = load_window_qk(q_base, addr, idx, dims, q_stride_n, stride_qkv_d, N, D,
                                                     COSINE)
        k_in, k_lowp, k_inv, k_norm = load_window_qk(k_base, addr, idx, dims, stride_qkv_n, stride_qkv_d, N, D,
                                                     COSINE)
        v = load_window_rows(v_base, addr, idx, dims, stride_qkv_n, stride_qkv_d, N, D)
        do = load_window_rows(dout_ptr + image * stride_dout_b + (h * D) * stride_dout_c, addr, idx, dims,
                              stride_dout_n, stride_dout_c, N, D)
        p, p_v, ds, key_scaled = softmax_backward_tile(q_in, q_inv, k_in, k_inv, v, do, s, s, s, bias_mask,
                                                       s * LOG2E, seed, b * H + h, idx, idx, dropout_p, N,
                                                       COSINE, FP32_DOT, True, HAS_DROPOUT)
        ds_lowp = ds.to(q_lowp.dtype)
        dv = mma(tl.trans(p_v.to(do.dtype)), do, tl.zeros((BLOCK_N, BLOCK_D), tl.float32), FP32_DOT)
        dq_acc = mma(ds_lowp, k_lowp, tl.zeros((BLOCK_N, BLOCK_D), tl.float32), FP32_DOT)
        dk_acc = mma(tl.trans(ds_lowp), q_lowp, tl.zeros((BLOCK_N, BLOCK_D), tl.float32), FP32_DOT)
        dq = input_grad(dq_acc, s, q_in, q_inv, q_norm, COSINE)
        dk = input_grad(dk_acc, s, k_in, k_inv, k_norm, COSINE)

        dq_base = dqkv_ptr + image * stride_dqkv_b + h * stride_dqkv_h
        store_window_rows(dq_base, dq, addr, idx, dims, stride_dqkv_n, stride_dqkv_d, N, D)
        store_window_rows(dq_base + stride_dqkv_p, dk, addr, idx, dims, stride_dqkv_n, stride_dqkv_d, N, D)
        store_window_rows(dq_base + 2 * stride_dqkv_p, dv, addr, idx, dims, stride_dqkv_n, stride_dqkv_d,
                          N, D)
        if BIAS_GRAD:
            dbias_acc += bias_grad_tile(ds, BIAS)
        if SCALE_GRAD:
            dscale_acc += tl.sum(ds * key_scaled, 1) * q_inv  # sum_j dZ_ij R_ij

    if BIAS_GRAD:
        ptrs = dbias_partial_ptr + group * stride_partial_group + (h * N + idx[:, None]) * N + idx[None, :]
        tl.store(ptrs, dbias_acc, mask=(idx[:, None] < N) & (idx[None, :] < N))
    if SCALE_GRAD:
        tl.store(dscale_partial_ptr + group * stride_partial_group + h,
                 logit_scale_grad(tl.sum(dscale_acc, 0), s, logit_scale_ptr, h))
