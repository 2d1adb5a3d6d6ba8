"""The additive score terms of the local-attention kernels: one constexpr switch, ``BIAS``.

Each kind gives the terms added to a tile's logits (log2 domain, fp32: one of the tile's
shape, one per query row) in two orientations: (rows, keys) to the kernels over query rows,
through ``row_tile_terms`` (what a program keeps before its loop over key tiles) and
``tile_bias`` (each tile's), and (keys, rows) to the dkdv kernel, ``score_bias``;
``bias_grad_step`` adds a tile's dS to the kind's gradient; ``bias_rows`` and
``store_bias_grad`` open and close a program's rows. ``NO_BIAS`` compiles them all away.

``DECOMPOSED``: decomposed relative position (SAM's image encoder, ViTDet, MViTv2). The keys
lie on a grid of ``key_w`` columns, key j at row j // key_w and column j % key_w; with
rel_h (B, H, S_q, key_h) and rel_w (B, H, S_q, key_w),
``bias[i, j] = rel_h[i, j // key_w] + rel_w[i, j % key_w]``: rank key_h + key_w per query,
never an S_q x S_k tensor. Its gradient: d rel_h[i, r] sums dS[i, j] over the keys of grid
row r, d rel_w[i, c] over those of column c.

Two layouts of a key tile, chosen per kernel by its plan (a constexpr, ``ROW_TILE``):

* a key tile is one grid row (BLOCK_N == key_w): rel_h adds one value per query row (a
  BLOCK_M vector per tile), rel_w the tile rel_w[rows, 0:key_w], a dense load; in the dq
  kernel d rel_h[:, r] is the tile's row sums, stored as they come (each row's keys are
  one tile), and d rel_w one (BLOCK_M, BLOCK_N) accumulator, dS added as it is;
* otherwise (windows of 14 x 14, grids of 40 columns, ...) the one-hot layout: a program
  loads its query rows' rel_h and rel_w once, (BLOCK_M, KEY_H_PAD) and (BLOCK_M,
  KEY_W_PAD) tiles, and a key tile's term is two products on the tensor cores, rel_h rows
  times the one-hot (KEY_H_PAD, BLOCK_N) matrix of the keys' grid rows plus rel_w rows times
  that of their columns: exact (one 1 per key), where gathering each of the tile's terms
  from rel_h and rel_w took two loads and their addresses per logit (the forward of SAM's
  14 x 14 windows ran 5x its time without the bias, H200). The dq kernel sums the gradients
  the same way round, dS times the keys' one-hot (BLOCK_N, KEY_H_PAD) matrices, into
  (BLOCK_M, KEY_H_PAD) and (BLOCK_M, KEY_W_PAD) accumulators.

Rows past S_q and keys past S_k read a clamped, valid element (their probabilities are 0 or
their rows are not stored): no predicate per element.
"""
import triton
import triton.language as tl

from .tiles import product

#: the kinds (ints: inductor passes a user kernel's constexprs on as literals), and the same as
#: the constexprs the jitted helpers compare with (a kernel reads no other globals)
NO_BIAS, DECOMPOSED = 0, 1
_DECOMPOSED = tl.constexpr(DECOMPOSED)
#: natural-log logits to the kernels' log2 domain
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def bias_rows(rel_h_ptr, rel_w_ptr, b, h, rows, S_q, stride_hb, stride_hh, stride_hs, stride_wb, stride_wh,
              stride_ws, BIAS: tl.constexpr):
    """Pointers to the rel_h and rel_w rows of query rows ``rows`` (a vector) of batch b,
    head h, clamped into [0, S_q): (BLOCK_M,) each, or (0, 0) without a bias."""
    if BIAS == _DECOMPOSED:
        clamped = tl.minimum(rows, S_q - 1).to(tl.int64)
        rh = rel_h_ptr + b.to(tl.int64) * stride_hb + h.to(tl.int64) * stride_hh + clamped * stride_hs
        rw = rel_w_ptr + b.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh + clamped * stride_ws
        return rh, rw
    else:
        return 0, 0


@triton.jit
def grid_rows(rh_rows, rw_rows, S_k, key_w, stride_hk, stride_wk, KEY_H_PAD: tl.constexpr,
              KEY_W_PAD: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The one-hot layout's operands: rel_h and rel_w of the query rows at ``rh_rows`` /
    ``rw_rows`` (``bias_rows``), (BLOCK_M, KEY_H_PAD) and (BLOCK_M, KEY_W_PAD) in the inputs'
    dtype, or their transposes with TRANSPOSED; zeros past the grid's sides (a one-hot
    product multiplies them by 0, and 0 * NaN would not vanish)."""
    hs = tl.arange(0, KEY_H_PAD)
    ws = tl.arange(0, KEY_W_PAD)
    if TRANSPOSED:
        rh = tl.load(rh_rows[None, :] + hs[:, None] * stride_hk, mask=hs[:, None] < S_k // key_w, other=0.0)
        rw = tl.load(rw_rows[None, :] + ws[:, None] * stride_wk, mask=ws[:, None] < key_w, other=0.0)
    else:
        rh = tl.load(rh_rows[:, None] + hs[None, :] * stride_hk, mask=hs[None, :] < S_k // key_w, other=0.0)
        rw = tl.load(rw_rows[:, None] + ws[None, :] * stride_wk, mask=ws[None, :] < key_w, other=0.0)
    return rh, rw


@triton.jit
def one_hot_bias(rh, rw, n0, offs, S_k, key_w, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr,
                 PRECISION: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The bias of the keys n0 + offs against the rows of ``grid_rows``'s (rh, rw), times
    log2(e), fp32: rh times the keys' one-hot grid rows plus rw times their one-hot columns,
    (rows, keys), or (keys, rows) with TRANSPOSED. Keys past S_k take the last key's terms
    (their logits are masked)."""
    keys = tl.minimum(n0 + offs, S_k - 1)
    key_row = keys // key_w
    key_col = keys - key_row * key_w
    if TRANSPOSED:
        one_h = key_row[:, None] == tl.arange(0, KEY_H_PAD)[None, :]
        one_w = key_col[:, None] == tl.arange(0, KEY_W_PAD)[None, :]
    else:
        one_h = tl.arange(0, KEY_H_PAD)[:, None] == key_row[None, :]
        one_w = tl.arange(0, KEY_W_PAD)[:, None] == key_col[None, :]
    if PRECISION == 0:  # 16-bit operands; else fp32 ones (the interpreter casts a bool to bf16's bits)
        one_h = one_h.to(rh.dtype)
        one_w = one_w.to(rw.dtype)
    else:
        one_h = one_h.to(tl.float32)
        one_w = one_w.to(tl.float32)
    if TRANSPOSED:
        tile = product(one_w, rw, product(one_h, rh, None, PRECISION), PRECISION)
    else:
        tile = product(rw, one_w, product(rh, one_h, None, PRECISION), PRECISION)
    return tile * _LOG2E


@triton.jit
def score_bias(rh_rows, rw_rows, n0, offs, S_k, key_w, stride_hk, stride_wk, BIAS: tl.constexpr,
               ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr,
               PRECISION: tl.constexpr):
    """The dkdv kernel's terms, (keys, rows): (the tile's term, the rows' term) of the bias of
    the keys n0 + offs against the query rows at ``rh_rows`` / ``rw_rows`` (``bias_rows``),
    times log2(e); the rows' term a vector (BLOCK_M,) added to every key (the row layout's
    rel_h, which the kernel folds into its log-sum-exps: no add per logit), 0.0 in the
    one-hot layout. (0.0, 0.0) without a bias. The kernels over query rows take the same
    terms in (rows, keys) from ``row_tile_terms`` and ``tile_bias``."""
    if BIAS == _DECOMPOSED:
        if ROW_TILE:  # the tile is grid row n0 // key_w, its keys the columns 0 ... key_w - 1
            rh = tl.load(rh_rows + (n0 // key_w) * stride_hk).to(tl.float32) * _LOG2E
            rw = tl.load(rw_rows[None, :] + offs[:, None] * stride_wk)
            return rw.to(tl.float32) * _LOG2E, rh
        else:
            rh, rw = grid_rows(rh_rows, rw_rows, S_k, key_w, stride_hk, stride_wk, KEY_H_PAD, KEY_W_PAD, True)
            return one_hot_bias(rh, rw, n0, offs, S_k, key_w, KEY_H_PAD, KEY_W_PAD, PRECISION, True), 0.0
    else:
        return 0.0, 0.0


@triton.jit
def row_tile_terms(rh_rows, rw_rows, offs, S_k, key_w, stride_hk, stride_wk, BIAS: tl.constexpr,
                   ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr):
    """What a program over query rows keeps of a bias before its loop over the key tiles:
    in the row layout (the tiles are the grid's rows 0, 1, ... in order: global attention)
    (rel_w[rows, 0:key_w] times log2(e), the same of every tile: loaded once; rel_h[rows, 0]
    times log2(e), the first tile's term); in the one-hot layout its rows of rel_w and rel_h
    (``grid_rows``). (0.0, 0.0) without a bias."""
    rw, rh = 0.0, 0.0
    if BIAS == _DECOMPOSED:
        if ROW_TILE:
            rw = tl.load(rw_rows[:, None] + offs[None, :] * stride_wk).to(tl.float32) * _LOG2E
            rh = tl.load(rh_rows).to(tl.float32) * _LOG2E
        else:
            rh, rw = grid_rows(rh_rows, rw_rows, S_k, key_w, stride_hk, stride_wk, KEY_H_PAD, KEY_W_PAD, False)
    return rw, rh


@triton.jit
def tile_bias(rw_tile, rh_next, rh_rows, n0, offs, S_k, key_w, stride_hk, BIAS: tl.constexpr,
              ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """(the tile's term, the rows' term, what the next tile takes) of the key tile at n0
    against the program's query rows (``score_bias``'s terms, (rows, keys)), from what
    ``row_tile_terms`` gave. In the row layout the tile's term is rel_w's tile, loaded once, the rows' term the
    one loaded during the previous tile, and the next row's is loaded now: its latency is
    hidden behind this tile's products (a load that feeds no product is not pipelined). In
    the one-hot layout (rw_tile, rh_next) are the rows of rel_w and rel_h, kept."""
    if BIAS == _DECOMPOSED:
        if ROW_TILE:
            after = tl.minimum(n0 // key_w + 1, S_k // key_w - 1)
            return rw_tile, rh_next, tl.load(rh_rows + after * stride_hk).to(tl.float32) * _LOG2E
        else:
            tile = one_hot_bias(rh_next, rw_tile, n0, offs, S_k, key_w, KEY_H_PAD, KEY_W_PAD, PRECISION, False)
            return tile, 0.0, rh_next
    else:
        return 0.0, 0.0, rh_next


@triton.jit
def bias_grad_step(grad_h, grad_w, ds, ds_operand, n0, offs, rows, S_q, S_k, key_w, drh_rows, stride_hk,
                   BIAS: tl.constexpr, ROW_TILE: tl.constexpr, KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr,
                   PRECISION: tl.constexpr):
    """(grad_h, grad_w) with the tile's dS (BLOCK_M, BLOCK_N) added (rows the queries; ``ds``
    fp32, ``ds_operand`` as the dq product takes it, in the inputs' dtype; the accumulators
    ``bias_grad_init``'s). ROW_TILE: the tile's row sums stored into d rel_h[:, n0 // key_w]
    (pointers ``drh_rows``, rows < S_q) right away, grad_w += dS. Otherwise dS times the keys'
    one-hot rows and columns, on the tensor cores as ``tiles.product`` multiplies (the one-hot
    matrices are exact in any dtype)."""
    if BIAS == _DECOMPOSED:
        if ROW_TILE:
            tl.store(drh_rows + (n0 // key_w) * stride_hk, tl.sum(ds, 1).to(drh_rows.dtype.element_ty),
                     mask=rows < S_q)
            grad_w += ds
        else:
            keys = tl.minimum(n0 + offs, S_k - 1)
            key_row = keys // key_w
            key_col = keys - key_row * key_w
            if PRECISION == 0:
                one_h = (key_row[:, None] == tl.arange(0, KEY_H_PAD)[None, :]).to(ds_operand.dtype)
                one_w = (key_col[:, None] == tl.arange(0, KEY_W_PAD)[None, :]).to(ds_operand.dtype)
                grad_h = tl.dot(ds_operand, one_h, grad_h)
                grad_w = tl.dot(ds_operand, one_w, grad_w)
            else:
                one_h = (key_row[:, None] == tl.arange(0, KEY_H_PAD)[None, :]).to(tl.float32)
                one_w = (key_col[:, None] == tl.arange(0, KEY_W_PAD)[None, :]).to(tl.float32)
                if PRECISION == 1:
                    grad_h = tl.dot(ds, one_h, grad_h, input_precision="ieee")
                    grad_w = tl.dot(ds, one_w, grad_w, input_precision="ieee")
                else:
                    grad_h = tl.dot(ds, one_h, grad_h, input_precision="tf32x3")
                    grad_w = tl.dot(ds, one_w, grad_w, input_precision="tf32x3")
    return grad_h, grad_w


@triton.jit
def bias_grad_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr, ROW_TILE: tl.constexpr,
                   KEY_H_PAD: tl.constexpr, KEY_W_PAD: tl.constexpr):
    """The dq kernel's accumulators of the bias gradient (fp32 zeros): (0, (BLOCK_M, BLOCK_N))
    with ROW_TILE, ((BLOCK_M, KEY_H_PAD), (BLOCK_M, KEY_W_PAD)) otherwise; (0, 0) without a bias."""
    if BIAS == _DECOMPOSED:
        if ROW_TILE:
            return 0.0, tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:
            return tl.zeros((BLOCK_M, KEY_H_PAD), tl.float32), tl.zeros((BLOCK_M, KEY_W_PAD), tl.float32)
    else:
        return 0.0, 0.0


@triton.jit
def store_bias_grad(grad_h, grad_w, drh_rows, drw_rows, rows, S_q, S_k, key_w, stride_hk, stride_wk,
                    BIAS: tl.constexpr, ROW_TILE: tl.constexpr, BLOCK_N: tl.constexpr, KEY_H_PAD: tl.constexpr,
                    KEY_W_PAD: tl.constexpr):
    """The accumulators into d rel_h and d rel_w (pointers to the program's rows, clamped as
    ``bias_rows``'s; only rows < S_q are stored)."""
    if BIAS == _DECOMPOSED:
        live = (rows < S_q)[:, None]
        if ROW_TILE:
            cols = tl.arange(0, BLOCK_N)
            tl.store(drw_rows[:, None] + cols[None, :] * stride_wk, grad_w.to(drw_rows.dtype.element_ty), mask=live)
        else:
            key_h = S_k // key_w
            hs = tl.arange(0, KEY_H_PAD)
            ws = tl.arange(0, KEY_W_PAD)
            tl.store(drh_rows[:, None] + hs[None, :] * stride_hk, grad_h.to(drh_rows.dtype.element_ty),
                     mask=live & (hs[None, :] < key_h))
            tl.store(drw_rows[:, None] + ws[None, :] * stride_wk, grad_w.to(drw_rows.dtype.element_ty),
                     mask=live & (ws[None, :] < key_w))
