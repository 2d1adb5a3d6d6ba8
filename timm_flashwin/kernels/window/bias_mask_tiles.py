"""Triton building blocks that read a tile of bias + mask, B[h] + M[w], for the forward and
backward kernels (``tiles.py`` has the rest of their shared tiles and the conventions).

The tile is read in the log2 domain, (B + M) * log2(e), as the logits are kept. The bias is
one switch, the kernels' BIAS (``call.NO_BIAS`` ...): ``bias_tile`` adds it (the dense
(H, N, N) one, the host's float16 copy of it, ``bias_mask.streamed_bias``, or a table (T, H)
read through an index) and ``bias_grad_tile`` is its gradient. The mask is the dense
(nW, N, N) one or, where the host found it to be timm's region mask, computed from (nW, N)
region ids (``bias_mask.mask_structure``): the kernels that loop over key or query blocks are
built once per kind of mask (``mask_kind_launch``).
"""
import triton
import triton.language as tl

from . import call
from .tiles import LOG2E

#: the bias kinds (``call.NO_BIAS`` ...) as the kernels' BIAS constexpr compares them
NO_BIAS = tl.constexpr(call.NO_BIAS)
DENSE_BIAS = tl.constexpr(call.DENSE_BIAS)
TABLE_BIAS = tl.constexpr(call.TABLE_BIAS)
LOG2E_COPY = tl.constexpr(call.LOG2E_COPY)


@triton.jit
def load_mask_regions(mask_info_ptr, MASK_REGIONS: tl.constexpr):
    """(structured, value) of the mask, read once per program: whether the launcher found
    the mask to be value * [region_i != region_j] (``mask_structure``), and that value."""
    if MASK_REGIONS:
        return tl.load(mask_info_ptr) != 0.0, tl.load(mask_info_ptr + 1)
    else:
        return False, 0.0


@triton.jit
def mask_kind_launch(mask_info_ptr, MASK_REGIONS: tl.constexpr, FROM_REGIONS: tl.constexpr):
    """(run, value) for a kernel built for one kind of mask (FROM_REGIONS: region ids, else
    dense) that the launcher launches once per kind where the mask may be either
    (MASK_REGIONS): whether this launch's kind is the mask's, and the region mask's value.
    Without MASK_REGIONS the one launch runs."""
    if MASK_REGIONS:
        mask_structured, mask_value = load_mask_regions(mask_info_ptr, True)
        return mask_structured == FROM_REGIONS, mask_value
    else:
        return True, 0.0


@triton.jit
def window_in_one_region(mask_info_ptr, w, FROM_REGIONS: tl.constexpr, ONE_REGION_LOOP: tl.constexpr):
    """Whether mask window ``w`` of a region mask is all one region, and so 0 everywhere
    (``mask_structure``'s info[2 + w]); False for a kernel built for the dense mask or
    without ONE_REGION_LOOP (``config.LaunchConfig.one_region_loop``).

    timm shifts its windows by half a window: only the windows of the last row and column
    hold several regions (7 of 16 windows of 4 x 4). With ONE_REGION_LOOP the kernels that
    stream key blocks run the others through a second copy of their loop, built without a
    mask, which drops the region comparison, its select and its add from every logit, and
    the region ids' loads."""
    if FROM_REGIONS and ONE_REGION_LOOP:
        return tl.load(mask_info_ptr + 2 + w) != 0.0
    else:
        return False


@triton.jit
def bias_tile(bias_ptr, index_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
              stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
              N: tl.constexpr, BIAS: tl.constexpr, BIAS_SIGMOID: tl.constexpr, HAS_MASK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FROM_REGIONS: tl.constexpr):
    """The score's additive term of one (rows, cols) tile, (B[h] + M[w]) * log2(e), fp32; -inf
    on padded columns. BIAS says what B is (``call.NO_BIAS`` ...; a constexpr: each build
    holds one branch): none, a dense (H, N, N) tensor (``dense_bias``), the host's float16
    copy of it, already times log2(e) (``bias_mask.streamed_bias``, read by the kernels that
    stream key blocks with 16-bit inputs; where it holds the mask too, those kernels are
    launched without HAS_MASK and their bias pointer steps to window w's slice: one multiply
    per logit fewer), or a table read through an index (``table_bias``, BIAS_SIGMOID its
    sigmoid scale). ``bias_grad_tile`` is its gradient. The mask: ``add_mask``.

    Every kernel computes its logits from this tile once per (query block, key block), so
    each elementwise operation here costs about as much as one of the softmax's own: B and M
    are scaled by log2(e) separately (a multiply-add each, not an add and a multiply).
    """
    if BIAS == TABLE_BIAS:
        bm = table_bias(bias_ptr, index_ptr, h, rows, cols, stride_bias_i, stride_bias_h, N, BIAS_SIGMOID)
    elif BIAS == NO_BIAS:
        bm = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        bm = dense_bias(bias_ptr, h, rows, cols, stride_bias_h, stride_bias_i, stride_bias_j, N,
                        BIAS == LOG2E_COPY)
    return add_mask(bm, mask_ptr, regions_ptr, mask_value, w, rows, cols, stride_mask_w, stride_mask_i, stride_mask_j,
                    N, HAS_MASK, BLOCK_N, FROM_REGIONS)


@triton.jit
def bias_grad_tile(ds, BIAS: tl.constexpr):
    """The gradient of the tile ``bias_tile`` adds, from the tile's dZ, that the kernels sum
    over the windows sharing it: dZ itself for every kind here (each adds its tile as it
    reads it; the table's rows are summed from it on the host, ``position_bias``). A kind
    that computes its tile from smaller factors (the next kinds: ``docs/design.md``, "Adding
    a bias kind") reduces dZ to them here."""
    return ds


@triton.jit
def dense_bias(bias_ptr, h, rows, cols, stride_bias_h, stride_bias_i, stride_bias_j, N: tl.constexpr,
               LOG2E_ALREADY: tl.constexpr):
    """B[h] * log2(e) of a dense bias (H, N, N), fp32, 0 outside the window; LOG2E_ALREADY: the
    bias read is the host's copy, times log2(e) already."""
    inside = (rows[:, None] < N) & (cols[None, :] < N)
    ptrs = bias_ptr + h * stride_bias_h + rows[:, None] * stride_bias_i + cols[None, :] * stride_bias_j
    bm = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    if not LOG2E_ALREADY:
        bm = bm * LOG2E
    return bm


@triton.jit
def table_bias(table_ptr, index_ptr, h, rows, cols, stride_table_t, stride_table_h, N: tl.constexpr,
               SIGMOID_SCALE: tl.constexpr):
    """B[h] * log2(e) with B[h, i, j] = table[index[i, j], h], or SIGMOID_SCALE *
    sigmoid(table[index[i, j], h]) in fp32 rounded to the table's dtype (SIGMOID_SCALE a float,
    0 for none): the values ``position.launch.relative_bias_gather`` writes, scaled in the same
    operations, so the tile is bit for bit the one read from the gathered bias. table (T, H)
    with strides (stride_table_t, stride_table_h); index (N, N) int32, contiguous.

    For the one-tile kernels, which read their tile once per program: the gather (and the
    sigmoid) costs once per program, not per window, and spares the gather's launch and the
    dense bias kept between the passes."""
    inside = (rows[:, None] < N) & (cols[None, :] < N)
    pairs = tl.load(index_ptr + rows[:, None] * N + cols[None, :], mask=inside, other=0)
    bias = tl.load(table_ptr + pairs * stride_table_t + h * stride_table_h, mask=inside, other=0.0)
    if SIGMOID_SCALE != 0:  # 0 on padded tokens, as the gathered bias is read there
        bias = tl.where(inside, (SIGMOID_SCALE * tl.sigmoid(bias.to(tl.float32))).to(table_ptr.dtype.element_ty), 0.0)
    return bias.to(tl.float32) * LOG2E


@triton.jit
def add_mask(bm, mask_ptr, regions_ptr, mask_value, w, rows, cols, stride_mask_w, stride_mask_i, stride_mask_j,
             N: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, FROM_REGIONS: tl.constexpr):
    """The bias tile ``bm`` (times log2(e)) plus M[w] * log2(e), -inf on padded columns (the
    padded-column select is compiled only where N is not a multiple of BLOCK_N).

    FROM_REGIONS: the mask is value * [region_i != region_j], computed from the (nW, N)
    region ids (the launcher found it so, ``mask_structure``) instead of read, adding value *
    log2(e) where the regions differ. The kind is known only at run time
    (``load_mask_regions``): the kernels that loop over key or query blocks are built for one
    kind each and launched once per kind, the programs of the other kind returning at once;
    the dbias kernel, which reads one tile per program, branches (``bias_tile_either``)."""
    inside = (rows[:, None] < N) & (cols[None, :] < N)
    if HAS_MASK:
        if FROM_REGIONS:
            region_rows = tl.load(regions_ptr + w * N + rows, mask=rows < N, other=0)
            region_cols = tl.load(regions_ptr + w * N + cols, mask=cols < N, other=0)
            bm = tl.where(region_rows[:, None] == region_cols[None, :], bm, bm + mask_value * LOG2E)
        else:
            ptrs = mask_ptr + w * stride_mask_w + rows[:, None] * stride_mask_i + cols[None, :] * stride_mask_j
            bm += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * LOG2E
    if N % BLOCK_N != 0:
        bm = tl.where(cols[None, :] < N, bm, float("-inf"))
    return bm


@triton.jit
def bias_tile_either(bias_ptr, mask_ptr, regions_ptr, mask_structured, mask_value, h, w, rows, cols,
                     stride_bias_h, stride_bias_i, stride_bias_j,
                     stride_mask_w, stride_mask_i, stride_mask_j,
                     N: tl.constexpr, BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``bias_tile`` with the mask's kind decided at run time (``mask_structured``, from
    ``load_mask_regions``). The dbias kernel reads its one tile per program with it.
    Not for a tile read inside a loop: the pipeliner does not fetch loads in a branch
    ahead, and the kernels that loop over blocks are built once per mask kind instead
    (``FROM_REGIONS``; H200, window 16, ncu: in the dkdv kernel, waits on the branch's loads
    were a fifth of the stall samples)."""
    if mask_structured:
        bm = bias_tile(bias_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
                       stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                       N, BIAS, 0.0, HAS_MASK, BLOCK_M, BLOCK_N, True)
    else:
        bm = bias_tile(bias_ptr, bias_ptr, mask_ptr, regions_ptr, mask_value, h, w, rows, cols,
                       stride_bias_h, stride_bias_i, stride_bias_j, stride_mask_w, stride_mask_i, stride_mask_j,
                       N, BIAS, 0.0, HAS_MASK, BLOCK_M, BLOCK_N, False)
    return bm
