"""Position-bias MLPs, table = dropout(relu(coords @ W1^T + b1)) @ W2^T (+ b2), in one kernel
forward and one backward.

timm's SwinV2 ``cpb_mlp`` is Linear(2, K) -> ReLU -> Linear(K, H, bias=False) on the (T, 2)
log-spaced relative coordinates (T = (2 * window - 1)^2, K = 512); SwinV2-CR's ``meta_mlp``
is timm's Mlp, Linear(2, K) -> ReLU -> Dropout(0.125) -> Linear(K, H) on the (N^2, 2) pairs
of a window's tokens (K = 384), its table the (H, N, N) bias itself. PyTorch runs such an
MLP as three to five kernels forward (two matmuls, the ReLU, the dropout; under autocast
two casts per linear layer more) and seven to nine backward, each with its autograd node:
small work whose cost in an eager training step is the host's, per layer. Here the forward
writes the table from the coordinates in one pass, the hidden activations never leaving
registers, and the backward recomputes them (the first layer has two inputs: two
multiply-adds per hidden value) to sum all weight gradients in one pass. The dropout mask
is an input (``DROPOUT``: a (T, K) tensor, nonzero where a hidden unit is kept), drawn by
the caller as timm's layer draws it. Everything in fp32 whatever the weights' dtype
(timm's autocast runs the MLP in bf16).
"""
import triton
import triton.language as tl


@triton.jit
def hidden_tile(coord0, coord1, w1_ptr, b1_ptr, ks, stride_w1_k, stride_w1_j, hidden):
    """(pre, hid) of rows x hidden units ``ks`` (fp32): pre = coords @ W1[ks]^T + b1[ks] and
    hid = relu(pre), NaN kept as NaN (torch.relu's rule; tl.maximum would give 0)."""
    in_k = ks < hidden
    w10 = tl.load(w1_ptr + ks * stride_w1_k, mask=in_k, other=0.0).to(tl.float32)
    w11 = tl.load(w1_ptr + ks * stride_w1_k + stride_w1_j, mask=in_k, other=0.0).to(tl.float32)
    b1 = tl.load(b1_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
    pre = tl.fma(coord0[:, None], w10[None, :], tl.fma(coord1[:, None], w11[None, :], b1[None, :]))
    return pre, tl.where(pre <= 0.0, 0.0, pre)


@triton.jit
def hidden_dropout_factor(keep_ptr, rows, ks, num_rows, hidden, stride_keep_t, stride_keep_k, keep_scale):
    """(rows x hidden units) fp32 factors of the dropout after the ReLU: keep_scale where the
    mask is nonzero, else 0 (a NaN activation times 0 stays NaN, as in PyTorch's dropout)."""
    keep = tl.load(keep_ptr + rows[:, None] * stride_keep_t + ks[None, :] * stride_keep_k,
                   mask=(rows[:, None] < num_rows) & (ks[None, :] < hidden), other=0)
    # fp32 whatever type keep_scale arrives in (inductor passes a user kernel's floats as fp64)
    return tl.where(keep != 0, keep_scale, 0.0).to(tl.float32)


@triton.jit
def load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j):
    in_rows = rows < num_rows
    coord0 = tl.load(coords_ptr + rows * stride_c_t, mask=in_rows, other=0.0).to(tl.float32)
    coord1 = tl.load(coords_ptr + rows * stride_c_t + stride_c_j, mask=in_rows, other=0.0).to(tl.float32)
    return coord0, coord1


@triton.jit
def position_mlp_fwd_kernel(
    coords_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, keep_ptr, out_ptr,
    num_rows, hidden, keep_scale,
    stride_c_t, stride_c_j, stride_w1_k, stride_w1_j, stride_w2_h, stride_w2_k, stride_keep_t, stride_keep_k,
    stride_out_t, stride_out_h,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_B2: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Grid: (T / BLOCK_T,). coords (T, 2), W1 (K, 2), b1 (K,), W2 (H, K), b2 (H,) (HAS_B2),
    the dropout mask (T, K) (DROPOUT), any float dtypes; out (T, H) fp32, any strides, =
    dropout(relu(coords @ W1^T + b1)) @ W2^T + b2, the hidden units BLOCK_K at a time."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    coord0, coord1 = load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        hid = hidden_tile(coord0, coord1, w1_ptr, b1_ptr, ks, stride_w1_k, stride_w1_j, hidden)[1]
        if DROPOUT:
            hid *= hidden_dropout_factor(keep_ptr, rows, ks, num_rows, hidden, stride_keep_t, stride_keep_k, keep_scale)
        w2t = tl.load(w2_ptr + heads[None, :] * stride_w2_h + ks[:, None] * stride_w2_k,
                      mask=(heads[None, :] < H) & (ks[:, None] < hidden), other=0.0).to(tl.float32)
        acc = tl.dot(hid, w2t, acc, input_precision="ieee")
    if HAS_B2:
        acc += tl.load(b2_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_out_t + heads[None, :] * stride_out_h
    tl.store(out, acc, mask=(rows[:, None] < num_rows) & (heads[None, :] < H))


@triton.jit
def position_mlp_bwd_kernel(
    grad_ptr, coords_ptr, w1_ptr, b1_ptr, w2_ptr, keep_ptr, partials_ptr,
    num_rows, hidden, blocks_per_program, keep_scale,
    stride_g_t, stride_g_h, stride_c_t, stride_c_j, stride_w1_k, stride_w1_j, stride_w2_h, stride_w2_k,
    stride_keep_t, stride_keep_k, stride_partials,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_B2: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Grid: (row groups, K / BLOCK_K). grad (T, H), the table's gradient, any strides.
    Program (g, c) takes hidden units c * BLOCK_K + [0, BLOCK_K) over the rows of its group
    (``blocks_per_program`` blocks of BLOCK_T rows) and writes that group's sums into row g
    of partials (groups, 3 K + H K (+ H)) fp32, laid out as [dW1 (K, 2) | db1 (K) | dW2 (H,
    K) | db2 (H), HAS_B2 only, written by the programs c = 0]. With hid = dropout(relu(pre)):

        dW2 = grad^T hid,  db2 = sum grad,  dpre = (grad W2) * dropout * [not pre <= 0],
        dW1 = dpre^T coords,  db1 = sum dpre

    (the ReLU's gradient passes where its output is not <= 0, as PyTorch's threshold_backward
    does: a NaN passes; the dropout's is its forward's factor)."""
    group = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    heads = tl.arange(0, BLOCK_H)
    in_k = ks < hidden
    w2 = tl.load(w2_ptr + heads[:, None] * stride_w2_h + ks[None, :] * stride_w2_k,
                 mask=(heads[:, None] < H) & in_k[None, :], other=0.0).to(tl.float32)
    dw2 = tl.zeros((BLOCK_H, BLOCK_K), tl.float32)
    dw10 = tl.zeros((BLOCK_K,), tl.float32)
    dw11 = tl.zeros((BLOCK_K,), tl.float32)
    db1 = tl.zeros((BLOCK_K,), tl.float32)
    db2 = tl.zeros((BLOCK_H,), tl.float32)
    for block in range(group * blocks_per_program, (group + 1) * blocks_per_program):
        rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
        coord0, coord1 = load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j)
        pre, hid = hidden_tile(coord0, coord1, w1_ptr, b1_ptr, ks, stride_w1_k, stride_w1_j, hidden)
        grad = tl.load(grad_ptr + rows[:, None] * stride_g_t + heads[None, :] * stride_g_h,
                       mask=(rows[:, None] < num_rows) & (heads[None, :] < H), other=0.0).to(tl.float32)
        dhid = tl.dot(grad, w2, input_precision="ieee")
        if DROPOUT:
            factor = hidden_dropout_factor(keep_ptr, rows, ks, num_rows, hidden, stride_keep_t, stride_keep_k,
                                           keep_scale)
            hid *= factor
            dhid *= factor
        dw2 = tl.dot(tl.trans(grad), hid, dw2, input_precision="ieee")
        dpre = tl.where(pre <= 0.0, 0.0, dhid)
        dw10 += tl.sum(dpre * coord0[:, None], axis=0)
        dw11 += tl.sum(dpre * coord1[:, None], axis=0)
        db1 += tl.sum(dpre, axis=0)
        if HAS_B2:
            db2 += tl.sum(grad, axis=0)
    partials = partials_ptr + group * stride_partials
    tl.store(partials + 2 * ks, dw10, mask=in_k)
    tl.store(partials + 2 * ks + 1, dw11, mask=in_k)
    tl.store(partials + 2 * hidden + ks, db1, mask=in_k)
    tl.store(partials + 3 * hidden + heads[:, None] * hidden + ks[None, :], dw2,
             mask=(heads[:, None] < H) & in_k[None, :])
    if HAS_B2:
        if tl.program_id(1) == 0:
            tl.store(partials + (3 + H) * hidden + heads, db2, mask=heads < H)
