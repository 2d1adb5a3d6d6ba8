"""Triton building blocks shared by the forward and backward kernels: scores and logits,
window rows, query and key tiles, dropout, the head scale, runs of windows. The tiles of
bias + mask are in ``bias_mask_tiles.py``.

Conventions used by every kernel:

* qkv is read in the layout the qkv linear produced, (B_, N, 3, H, D) flattened to
  (B_, N, 3*H*D), through its (batch, token, channel) strides: no permute copy.
* Logits are kept in the log2 domain, Z2 = (s * R + B + M) * log2(e) with the score
  product R = Q K^T (V1, ``qk_product``) or Q^ K^^T (cosine, ``key_scaled_scores``), so
  that the softmax uses ``exp2``. R stays available to the backward, which needs
  sum(dZ * R) for the gradient of the cosine scale s.
* Padded rows/columns (N is not a power of two) load as 0; padded key columns get a
  logit of -inf so they take no probability.
* Window b's token t is row t of qkv[b] (the partitioned layout), or with MAPPED the row
  of qkv[b // nW] where timm's shift and partition take it from (the feature-map layout:
  qkv (B, H*W, 3*H*D) as the qkv linear produces it on the unpartitioned map,
  ``window_rows``); the output and the gradients are written in the same layout, so the
  shift and the window partition and merge around the op cost no copies.
* Attention dropout draws one Philox number per probability P[b, h, i, j] from a seed
  and the element's flat index ((b * H + h) * N + i) * N + j: the forward and every
  backward kernel regenerate the same keep mask from the same two numbers, whatever
  their tiling.
"""
import math

import torch
import triton
import triton.language as tl

#: timm clamps the cosine-attention logit scale at ln(1 / 0.01) before ``exp``.
LOGIT_SCALE_MAX_VALUE = math.log(1.0 / 0.01)


def _clamp_passes_gradient_at_its_bound() -> bool:
    """Whether torch.clamp(x, max=m) gives x a gradient where x == m: torch up to 2.11 does
    (subgradient 1), later ones do not (pytorch#191142, the minimum-norm subgradient). The
    kernels, which clamp the logit scale themselves, follow the torch they run with, as
    timm's own logit-scale gradient does. A rule of autograd's derivative formulas, the
    same on every device: probed once, on the CPU."""
    with torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        torch.clamp(x, max=1.0).backward()
    return bool(x.grad[0] != 0)


#: torch.clamp's gradient at its bound on this torch (``_clamp_passes_gradient_at_its_bound``).
CLAMP_GRADIENT_AT_BOUND_VALUE = _clamp_passes_gradient_at_its_bound()

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log logits -> log2 logits
NORM_EPS = tl.constexpr(1e-12)  # F.normalize's eps
LOGIT_SCALE_MAX = tl.constexpr(LOGIT_SCALE_MAX_VALUE)  # timm's clamp of the cosine logit scale, ln 100
CLAMP_GRADIENT_AT_BOUND = tl.constexpr(CLAMP_GRADIENT_AT_BOUND_VALUE)  # torch.clamp's rule on this torch


@triton.jit
def mma(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation, bf16/fp16 operands on the tensor cores.

    FP32_DOT computes in full fp32 ("ieee") instead: for float32 inputs (no tf32
    rounding) and under the interpreter, whose bf16 dot is wrong (it multiplies the uint16
    bit patterns it holds bf16 in, triton 3.6 to 3.9).
    """
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def qk_product(q_in, k_in, FP32_DOT: tl.constexpr):
    """Q K^T of one tile, fp32, from the q and k tiles as loaded (``load_qk``): V1's score
    product, in the input dtype's operands as timm multiplies them."""
    if FP32_DOT:
        return tl.dot(q_in.to(tl.float32), tl.trans(k_in.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q_in, tl.trans(k_in))


@triton.jit
def key_scaled_scores(q_in, k_in, k_inv, FP32_DOT: tl.constexpr):
    """T_ij = (q_i . k_j) / max(||k_j||, eps) of one tile, fp32: the cosine scores
    R_ij = T_ij / max(||q_i||, eps) without their rows' factor, which the callers fold into
    the multiply-add that adds the bias (times the scale) and apply to row sums of T.

    From the unnormalized inputs as loaded: a product of two bf16 or fp16 numbers is exact
    in fp32, so R is as precise as the fp32 accumulation (about 2^-22 of ||q|| ||k||), one
    tensor-core product. Normalizing first would round q^ and k^ to the operand dtype,
    and the logit scale (up to 100) would turn that rounding (2^-9 in bf16) into logit
    errors of 0.05 to 0.2.
    """
    return qk_product(q_in, k_in, FP32_DOT) * k_inv[None, :]


@triton.jit
def logits_tile(q_in, k_in, k_inv, q_scale, logit_scale2, bias_mask, COSINE: tl.constexpr, FP32_DOT: tl.constexpr):
    """(T, Z2) of one tile, fp32: the score product as the backward's scale gradient and the
    forward's mean score take it, and the log2-domain logits Z2 = T times its factor plus
    ``bias_mask`` (``bias_mask_tiles.bias_tile``), one multiply-add per logit, written as ``tl.fma`` so
    that it is contracted whatever the compile options. The forward and every backward
    kernel compute their logits here, so that the backward's P is the forward's.

    V1: T = Q K^T (``qk_product``), its factor ``logit_scale2`` (the scale times log2(e)).
    Cosine: T = R diag(max(||q||, eps)) (``key_scaled_scores``), its factor ``q_scale``, the
    rows' inverse norms times ``logit_scale2``, riding on the multiply-add: two operations
    per logit, not three."""
    if COSINE:
        key_scaled = key_scaled_scores(q_in, k_in, k_inv, FP32_DOT)
        return key_scaled, tl.fma(key_scaled, q_scale[:, None], bias_mask)
    else:
        qk = qk_product(q_in, k_in, FP32_DOT)
        return qk, tl.fma(qk, logit_scale2, bias_mask)


@triton.jit
def window_rows(b, tokens, map_windows, windows_x, map_height, map_width, shift_h, shift_w,
                N: tl.constexpr, WINDOW_W: tl.constexpr, MAPPED: tl.constexpr):
    """(image, rows): where the tokens ``tokens`` of window b lie, as the rows ``rows`` of
    image ``image`` of qkv, the output and their gradients.

    MAPPED 0, the partitioned layout: (b, tokens). Else the feature-map layout (windows of
    N / WINDOW_W x WINDOW_W tokens, nW = ``map_windows`` per image and nWx = ``windows_x`` per
    map row, a (``map_height``, ``map_width``) map, its shift: ``WindowGrid.kernel_args``):
    window b is window w = b % nW of image b // nW, at (wy, wx) = (w // nWx, w % nWx), and its
    token t at (i, j) = (t // WINDOW_W, t % WINDOW_W) reads the map, with MAPPED 1 (block
    windows), at ((wy * wh + i + shift_h) mod H, (wx * ww + j + shift_w) mod W), where timm's
    roll by -shift and partition put it; with MAPPED 2 (MaxViT's grid windows, no shift) at
    (i * nWy + wy, j * nWx + wx), nWy = nW / nWx, where timm's grid_partition takes it.
    Computed from the token numbers and run-time scalars (a few integer operations per row,
    which the compiler redoes in each layout the loads and stores take), not read from a
    table (a (nW, N) table: the one-tile backward 255 registers and a spill, against 193),
    nor from a tensor of the geometry (passed down as a tuple it made torch 2.11's analysis
    of which tensors a user kernel writes give up and take every input for written).
    Padded tokens (t >= N) get rows out of range: the loads and stores mask them by token."""
    if MAPPED == 0:
        return b, tokens
    else:
        WINDOW_H: tl.constexpr = N // WINDOW_W
        # int32 division: int64 division by a run-time value is a long routine (with it, the
        # one-tile backward took 255 registers and spilled, against 188 partitioned)
        window = b.to(tl.int32)
        image = window // map_windows
        w = window - image * map_windows
        wy = w // windows_x
        wx = w - wy * windows_x
        if MAPPED == 2:
            y = (tokens // WINDOW_W) * (map_windows // windows_x) + wy
            x = (tokens % WINDOW_W) * windows_x + wx
        else:
            y = wy * WINDOW_H + tokens // WINDOW_W + shift_h
            x = wx * WINDOW_W + tokens % WINDOW_W + shift_w
            y = tl.where(y >= map_height, y - map_height, y)  # mod H: y < H + wh <= 2 H
            x = tl.where(x >= map_width, x - map_width, x)
        return image.to(tl.int64), y * map_width + x


@triton.jit
def query_base(qkv_ptr, q_ptr, image, h, stride_qkv_b, stride_qkv_n, stride_q_b, stride_q_n, stride_h, query_windows,
               GLOBAL_QUERY: tl.constexpr):
    """(where the queries of head h of window ``image`` (``window_rows``' image) start, the
    stride of their token rows). GLOBAL_QUERY 0: in qkv, at its strides (q_ptr, stride_q_b and
    stride_q_n are not read: the compiler keeps no registers for them, and a launch passes an
    unused tensor as q_ptr, not qkv twice, which torch.compile would copy where qkv is a view,
    ``launcher.unused_pointer``). Else in q_ptr, a tensor of one query per image that the
    image's windows share (GCViT's global query): window b takes image b // ``query_windows``
    (1: an image's windows in a row, timm's ``repeat_interleave``) or b % ``query_windows``
    (2: the images in a row, ``repeat``)."""
    if GLOBAL_QUERY == 0:
        return qkv_ptr + image * stride_qkv_b + h * stride_h, stride_qkv_n
    elif GLOBAL_QUERY == 1:
        return q_ptr + (image // query_windows) * stride_q_b + h * stride_h, stride_q_n
    else:
        return q_ptr + (image % query_windows) * stride_q_b + h * stride_h, stride_q_n


@triton.jit
def key_base(qkv_ptr, image, h, stride_b, stride_p, stride_h, GLOBAL_QUERY: tl.constexpr):
    """Where the keys of head h of window ``image`` start (the values: stride_p further):
    qkv's second third, or, where the queries are a tensor of their own (GLOBAL_QUERY), the
    first of the two thirds of the keys and values that qkv then holds."""
    base = qkv_ptr + image * stride_b + h * stride_h
    if GLOBAL_QUERY == 0:
        base += stride_p
    return base


@triton.jit
def load_window_rows(ptr, addr, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    """(len(rows), len(cols)) tile of the tokens ``rows`` of a window, read at the rows
    ``addr`` (``window_rows``); tokens beyond N and columns beyond D read 0."""
    ptrs = ptr + addr[:, None] * stride_row + cols[None, :] * stride_col
    return tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < D), other=0.0)


@triton.jit
def store_window_rows(ptr, value, addr, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    """``load_window_rows``'s store."""
    ptrs = ptr + addr[:, None] * stride_row + cols[None, :] * stride_col
    tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=(rows[:, None] < N) & (cols[None, :] < D))


@triton.jit
def load_rows(ptr, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    """(len(rows), len(cols)) tile of a (N, D) matrix; out-of-range entries read 0."""
    return load_window_rows(ptr, rows, rows, cols, stride_row, stride_col, N, D)


@triton.jit
def store_rows(ptr, value, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    store_window_rows(ptr, value, rows, rows, cols, stride_row, stride_col, N, D)


@triton.jit
def load_qk(ptr, rows, cols, stride_n, stride_c, N: tl.constexpr, D: tl.constexpr, COSINE: tl.constexpr):
    """``load_window_qk`` of the partitioned layout."""
    return load_window_qk(ptr, rows, rows, cols, stride_n, stride_c, N, D, COSINE)


@triton.jit
def load_window_qk(ptr, addr, rows, cols, stride_n, stride_c, N: tl.constexpr, D: tl.constexpr,
                   COSINE: tl.constexpr):
    """A query or key tile as the kernels use it, the tokens ``rows`` of a window read at
    the rows ``addr`` (``window_rows``): (x, lowp, inv, norm).

    x is the tile as loaded (input dtype), the operand of the scores (``qk_product``). For
    cosine attention inv = 1 / max(||x||, eps) and norm = ||x|| per row, and lowp is
    x^ = x / max(||x||, eps) in the input dtype; for V1 lowp is x, inv ones and norm
    zeros. lowp is the operand of the gradient products.
    """
    x_in = load_window_rows(ptr, addr, rows, cols, stride_n, stride_c, N, D)
    if COSINE:
        norm, inv = row_norms(x_in)
        x_lowp = unit_rows(x_in, inv).to(x_in.dtype)
    else:
        norm = tl.zeros((x_in.shape[0],), tl.float32)
        inv = norm + 1.0
        x_lowp = x_in
    return x_in, x_lowp, inv, norm


@triton.jit
def row_norms(x_in):
    """(||x_i||, 1 / max(||x_i||, eps)) of the rows of a tile as loaded, fp32."""
    x = x_in.to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    return norm, 1.0 / tl.maximum(norm, NORM_EPS)


@triton.jit
def unit_rows(x_in, inv):
    """x^ = x / max(||x||, eps) in fp32, from the tile as loaded and its rows' inverse norms
    inv = 1 / max(||x||, eps) (``row_norms``): a multiply per element, not a division (the
    compiler's fp32 division takes four to five instructions)."""
    return x_in.to(tl.float32) * inv[:, None]


@triton.jit
def normalize_backward(dxhat, x_in, inv, x_norm):
    """Gradient through x^ = x / max(||x||, eps), given dL/dx^ (fp32) and the tile x as
    loaded.

    dx = (dx^ - [||x|| > eps] * x^ * <x^, dx^>) / max(||x||, eps)
    """
    xhat = unit_rows(x_in, inv)
    proj = tl.where(x_norm > NORM_EPS, tl.sum(xhat * dxhat, axis=1), 0.0)
    return (dxhat - xhat * proj[:, None]) * inv[:, None]


@triton.jit
def dropout_factor(seed, bh, rows, cols, dropout_p, N: tl.constexpr):
    """keep / (1 - p) for the (rows, cols) tile of window-head ``bh`` (fp32): 0 where the
    probability is dropped, 1 / (1 - p) where it is kept, as nn.Dropout scales.

    Callers multiply by it (rather than select), so that a NaN probability stays NaN
    where it is dropped, as ``attn * mask`` does in timm.
    """
    p = tl.cast(dropout_p, tl.float32)  # inductor passes Python floats as fp64
    offsets = (bh * N + rows[:, None]) * N + cols[None, :]
    keep = tl.rand(seed, offsets) >= p
    return tl.where(keep, 1.0 / (1.0 - p), 0.0)


@triton.jit
def exp_float64(x):
    """exp of a float32 scalar computed in float64, rounded to float32: within half an ulp.
    For the head scale s = exp(logit scale), one per program: float32 ``tl.exp`` (exp2 of a
    rounded product, ex2.approx on the GPU) is 3 to 5 ulp off, and s (up to 100) multiplies
    every logit, which moved float32 SwinV2 gradients past timm's own float32 error
    (tests/test_training.py, gradient checkpointing)."""
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def head_scale(logit_scale_ptr, h, scale, COSINE: tl.constexpr):
    """The factor s of the scores S = s * Q^ K^^T: for cosine attention
    s = exp(min(logit_scale[h], ln 100)), computed here from the module's own parameter
    (a NaN logit scale gives NaN, as torch.clamp does); ``scale`` for V1.

    Computed in the kernels rather than by the host: in eager mode that is two kernel
    launches fewer per forward (clamp, exp) and their autograd nodes fewer per backward
    (``logit_scale_grad``)."""
    if COSINE:
        logit_scale = tl.load(logit_scale_ptr + h).to(tl.float32)
        return exp_float64(tl.minimum(logit_scale, LOGIT_SCALE_MAX, propagate_nan=tl.PropagateNan.ALL))
    else:
        return tl.cast(scale, tl.float32)  # inductor passes Python floats as fp64


@triton.jit
def logit_scale_grad(scale_grad, s, logit_scale_ptr, h):
    """d(logit_scale[h]) from a sum of d(head scale) terms, given the head scale s
    (``head_scale``): times ds/d(logit_scale) = s below the clamp at ln 100 (where s is
    exp(logit_scale)), 0 above it and where the logit scale is NaN, and at the bound itself
    whatever this torch's torch.clamp gives (``CLAMP_GRADIENT_AT_BOUND``), as autograd gives
    through torch.clamp(max=) and exp."""
    logit_scale = tl.load(logit_scale_ptr + h).to(tl.float32)
    if CLAMP_GRADIENT_AT_BOUND:
        unclamped = logit_scale <= LOGIT_SCALE_MAX
    else:
        unclamped = logit_scale < LOGIT_SCALE_MAX
    return tl.where(unclamped, scale_grad * s, 0.0)


@triton.jit
def window_run(group, num_periods, windows_per_period, windows_per_program):
    """(w, first, last) of a program that takes a run of windows: ``group`` = run * nW + w,
    the run's windows b = w + nW * [first, last) all sharing mask window w (and so one bias
    and mask tile); runs of ``windows_per_program`` windows (``config.split_windows``)."""
    w = group % num_periods
    first = (group // num_periods) * windows_per_program
    return w, first, tl.minimum(first + windows_per_program, windows_per_period)
