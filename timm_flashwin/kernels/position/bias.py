"""The relative-position bias gathered from its table, and the table's gradient.

timm's V1 and SwinV2 modules gather the dense bias B[h, p] = table[index[p], h] (p runs
over the N*N token pairs). ``relative_bias_gather_kernel`` writes B in its (H, N, N)
layout in one pass (PyTorch's gather and the permuted copy after it took 206 us for the
window-24 bias on an H100). The gradient sums, for every table row t, the bias gradient
over the pairs that read it: dtable[t, h] = sum of dB[h, p] over p with index[p] == t.
PyTorch computes that with a sort of the index in every backward (index_put with
accumulation: some ten small kernels); the pairs of each row never change, so they are
sorted once (``position_bias.TableRows``) and ``relative_bias_table_grad_kernel`` sums
each row's pairs in a fixed order: deterministic, one launch. Under torch.compile the
pairs of a module's index are sorted once, when the graph is traced (a constant of the
graph); the kernel then checks that each pair it sums reads its row (CHECK_INDEX), so
that an index changed after tracing makes the rows it no longer matches NaN instead of
silently wrong (if no pair mismatches, every row holds exactly its pairs: the order is
a permutation of all N*N pairs).

SwinV2 takes B = 16 * sigmoid(table[index]) (SIGMOID_SCALE = 16): the gather applies it,
and since every pair of a table row reads the same value x, that row's gradient is its
pairs' sum times 16 * sigmoid(x) * (1 - sigmoid(x)), applied once per row: the sigmoid,
the product and their backwards launch no kernels of their own.
"""
import triton
import triton.language as tl


@triton.jit
def relative_bias_table_grad_kernel(
    grad_ptr, order_ptr, offsets_ptr, index_ptr, table_ptr, out_ptr,
    num_rows, stride_grad_h, stride_table_t, stride_table_h, stride_out_t, stride_out_h,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
    CHECK_INDEX: tl.constexpr, SIGMOID_SCALE: tl.constexpr,
):
    """Grid: (table rows / BLOCK_T,). grad (H, N*N) fp32 or the bias dtype; order (N*N,)
    the pairs sorted by table row, offsets (T + 1,) where each row's pairs start in it;
    out (T, H). Each row's pairs are summed BLOCK_J at a time, the blocks in order, up to
    the longest row of the program's rows. CHECK_INDEX: index (N*N,) is read at every
    pair, and a row with a pair whose index is not the row is NaN. SIGMOID_SCALE
    (a float, or 0 for none): the gradient of SIGMOID_SCALE * sigmoid(table), the row sums
    times SIGMOID_SCALE * s * (1 - s), s = sigmoid(table[t, h]) (table (T, H), any float
    dtype)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    in_table = rows < num_rows
    start = tl.load(offsets_ptr + rows, mask=in_table, other=0)
    count = tl.load(offsets_ptr + rows + 1, mask=in_table, other=0) - start
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    mismatches = tl.zeros((BLOCK_T,), tl.int32)
    for j0 in range(0, tl.max(count, 0), BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        taken = j[None, :] < count[:, None]  # (BLOCK_T, BLOCK_J)
        pair = tl.load(order_ptr + start[:, None] + j[None, :], mask=taken, other=0)
        ptrs = grad_ptr + heads[None, None, :] * stride_grad_h + pair[:, :, None]
        grads = tl.load(ptrs, mask=taken[:, :, None] & (heads[None, None, :] < H), other=0.0)
        acc += tl.sum(grads.to(tl.float32), axis=1)
        if CHECK_INDEX:
            reads = tl.load(index_ptr + pair, mask=taken, other=0)
            mismatches += tl.sum((taken & (reads != rows[:, None])).to(tl.int32), axis=1)
    if CHECK_INDEX:
        acc = tl.where(mismatches[:, None] > 0, float("nan"), acc)
    inside = in_table[:, None] & (heads[None, :] < H)
    if SIGMOID_SCALE != 0:
        x = tl.load(table_ptr + rows[:, None] * stride_table_t + heads[None, :] * stride_table_h, mask=inside)
        s = tl.sigmoid(x.to(tl.float32))
        acc = acc * (SIGMOID_SCALE * s * (1.0 - s))
    out = out_ptr + rows[:, None] * stride_out_t + heads[None, :] * stride_out_h
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def relative_bias_gather_kernel(
    table_ptr, index_ptr, out_ptr, num_pairs, stride_table_t, stride_table_h, stride_out_h,
    H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, SIGMOID_SCALE: tl.constexpr,
):
    """Grid: (N*N / BLOCK_P,). out[h, p] = table[index[p], h], or with SIGMOID_SCALE (a float,
    0 for none) SIGMOID_SCALE * sigmoid(table[index[p], h]) computed in fp32; index (N*N,)
    int64 (timm's buffer, flattened), out (H, N*N) contiguous rows."""
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    heads = tl.arange(0, BLOCK_H)
    inside = (pairs[None, :] < num_pairs) & (heads[:, None] < H)
    rows = tl.load(index_ptr + pairs, mask=pairs < num_pairs, other=0)
    values = tl.load(table_ptr + rows[None, :] * stride_table_t + heads[:, None] * stride_table_h, mask=inside)
    if SIGMOID_SCALE != 0:
        values = SIGMOID_SCALE * tl.sigmoid(values.to(tl.float32))
    tl.store(out_ptr + heads[:, None] * stride_out_h + pairs[None, :], values.to(out_ptr.dtype.element_ty), mask=inside)
