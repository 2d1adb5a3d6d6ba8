"""SwinV2's continuous position bias MLP, table = relu(coords @ W1^T + b1) @ W2^T, in one
kernel forward and one backward.

timm's ``cpb_mlp`` is Linear(2, K) -> ReLU -> Linear(K, H, bias=False) on the (T, 2)
log-spaced relative coordinates (T = (2 * window - 1)^2, K = 512). PyTorch runs it as
three kernels forward (two matmuls and the ReLU; under autocast two casts of the weights
more) and five backward (two matmuls for the second layer, the ReLU's, one matmul and one
sum for the first layer), each with its autograd node: small work whose cost in an eager
training step is the host's, per layer. Here the forward writes the table from the
coordinates in one pass, the hidden activations never leaving registers, and the backward
recomputes them (the first layer has two inputs: two multiply-adds per hidden value) to
sum all three weight gradients in one pass. Everything in fp32 whatever the weights' dtype
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
def load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j):
    in_rows = rows < num_rows
    coord0 = tl.load(coords_ptr + rows * stride_c_t, mask=in_rows, other=0.0).to(tl.float32)
    coord1 = tl.load(coords_ptr + rows * stride_c_t + stride_c_j, mask=in_rows, other=0.0).to(tl.float32)
    return coord0, coord1


@triton.jit
def position_mlp_fwd_kernel(
    coords_ptr, w1_ptr, b1_ptr, w2_ptr, out_ptr,
    num_rows, hidden,
    stride_c_t, stride_c_j, stride_w1_k, stride_w1_j, stride_w2_h, stride_w2_k, stride_out_t, stride_out_h,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid: (T / BLOCK_T,). coords (T, 2), W1 (K, 2), b1 (K,), W2 (H, K), any float dtype;
    out (T, H) fp32 = relu(coords @ W1^T + b1) @ W2^T, the hidden units BLOCK_K at a time."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    coord0, coord1 = load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        hid = hidden_tile(coord0, coord1, w1_ptr, b1_ptr, ks, stride_w1_k, stride_w1_j, hidden)[1]
        w2t = tl.load(w2_ptr + heads[None, :] * stride_w2_h + ks[:, None] * stride_w2_k,
                      mask=(heads[None, :] < H) & (ks[:, None] < hidden), other=0.0).to(tl.float32)
        acc = tl.dot(hid, w2t, acc, input_precision="ieee")
    out = out_ptr + rows[:, None] * stride_out_t + heads[None, :] * stride_out_h
    tl.store(out, acc, mask=(rows[:, None] < num_rows) & (heads[None, :] < H))


@triton.jit
def position_mlp_bwd_kernel(
    grad_ptr, coords_ptr, w1_ptr, b1_ptr, w2_ptr, partials_ptr,
    num_rows, hidden, blocks_per_program,
    stride_g_t, stride_g_h, stride_c_t, stride_c_j, stride_w1_k, stride_w1_j, stride_w2_h, stride_w2_k,
    stride_partials,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid: (row groups, K / BLOCK_K). grad (T, H), the table's gradient. Program (g, c)
    takes hidden units c * BLOCK_K + [0, BLOCK_K) over the rows of its group
    (``blocks_per_program`` blocks of BLOCK_T rows) and writes that group's sums into row g
    of partials (groups, 3 K + H K) fp32, laid out as [dW1 (K, 2) | db1 (K) | dW2 (H, K)]:

        dW2 = grad^T hid,  dpre = (grad W2) * [not pre <= 0],  dW1 = dpre^T coords,  db1 = sum dpre

    (the ReLU's gradient passes where its output is not <= 0, as PyTorch's threshold_backward
    does: a NaN passes)."""
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
    for block in range(group * blocks_per_program, (group + 1) * blocks_per_program):
        rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
        coord0, coord1 = load_coords(coords_ptr, rows, num_rows, stride_c_t, stride_c_j)
        pre, hid = hidden_tile(coord0, coord1, w1_ptr, b1_ptr, ks, stride_w1_k, stride_w1_j, hidden)
        grad = tl.load(grad_ptr + rows[:, None] * stride_g_t + heads[None, :] * stride_g_h,
                       mask=(rows[:, None] < num_rows) & (heads[None, :] < H), other=0.0).to(tl.float32)
        dw2 = tl.dot(tl.trans(grad), hid, dw2, input_precision="ieee")
        dhid = tl.dot(grad, w2, input_precision="ieee")
        dpre = tl.where(pre <= 0.0, 0.0, dhid)
        dw10 += tl.sum(dpre * coord0[:, None], axis=0)
        dw11 += tl.sum(dpre * coord1[:, None], axis=0)
        db1 += tl.sum(dpre, axis=0)
    partials = partials_ptr + group * stride_partials
    tl.store(partials + 2 * ks, dw10, mask=in_k)
    tl.store(partials + 2 * ks + 1, dw11, mask=in_k)
    tl.store(partials + 2 * hidden + ks, db1, mask=in_k)
    tl.store(partials + 3 * hidden + heads[:, None] * hidden + ks[None, :], dw2,
             mask=(heads[:, None] < H) & in_k[None, :])
