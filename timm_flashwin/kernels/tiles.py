"""Triton building blocks shared by the forward and backward kernels.

Conventions used by every kernel:

* qkv is read in the layout the qkv linear produced, (B_, N, 3, H, D) flattened to
  (B_, N, 3*H*D), through its (batch, token, channel) strides: no permute copy.
* Logits are kept in the log2 domain, Z2 = (s * R + B + M) * log2(e) with the raw
  product R = Q^ K^^T, so that the softmax uses ``exp2``. R stays available to the
  backward, which needs sum(dZ * R) for the gradient of the cosine scale s.
* Padded rows/columns (N is not a power of two) load as 0; padded key columns get a
  logit of -inf so they take no probability.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log logits -> log2 logits
NORM_EPS = tl.constexpr(1e-12)  # F.normalize's eps


@triton.jit
def mma(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    bf16/fp16 operands use the tensor cores natively, fp32 operands as tf32 (the cosine
    scores). FP32_DOT computes in full fp32 ("ieee") instead: for float32 inputs (no tf32
    rounding) and under the interpreter, whose bf16 dot is not exact.
    """
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def load_rows(ptr, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    """(len(rows), len(cols)) tile of a (N, D) matrix; out-of-range entries read 0."""
    ptrs = ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
    return tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < D), other=0.0)


@triton.jit
def store_rows(ptr, value, rows, cols, stride_row, stride_col, N: tl.constexpr, D: tl.constexpr):
    ptrs = ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
    tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=(rows[:, None] < N) & (cols[None, :] < D))


@triton.jit
def load_qk(ptr, rows, cols, stride_n, stride_c, N: tl.constexpr, D: tl.constexpr, COSINE: tl.constexpr):
    """A query or key tile as the kernels use it: (score, lowp, hat, inv, norm).

    hat is x^ in fp32: x itself (V1) or x / max(||x||, eps) per row (cosine), with
    inv = 1 / max(||x||, eps) and norm = ||x|| (ones and zeros for V1). lowp is x^ in the
    input dtype, the operand of the gradient products. score is the operand of the score
    product: the input dtype for V1 (timm's own precision), fp32 for cosine attention,
    where a logit scale up to 100 would turn bf16 rounding of x^ (2^-9) into logit
    errors of ~0.2; fp32 operands run as tf32 on the tensor cores.
    """
    x_in = load_rows(ptr, rows, cols, stride_n, stride_c, N, D)
    x = x_in.to(tl.float32)
    if COSINE:
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        inv = 1.0 / tl.maximum(norm, NORM_EPS)
        x_hat = x * inv[:, None]
        x_lowp = x_hat.to(x_in.dtype)
        x_score = x_hat
    else:
        norm = tl.zeros((x.shape[0],), tl.float32)
        inv = norm + 1.0
        x_hat = x
        x_lowp = x_in
        x_score = x_in
    return x_score, x_lowp, x_hat, inv, norm


@triton.jit
def normalize_backward(dxhat, xhat, inv, x_norm):
    """Gradient through x^ = x / max(||x||, eps), given dL/dx^ and x^ (fp32 tiles).

    dx = (dx^ - [||x|| > eps] * x^ * <x^, dx^>) / max(||x||, eps)
    """
    proj = tl.where(x_norm > NORM_EPS, tl.sum(xhat * dxhat, axis=1), 0.0)
    return (dxhat - xhat * proj[:, None]) * inv[:, None]


@triton.jit
def head_scale(head_scale_ptr, h, scale, COSINE: tl.constexpr):
    """The factor s of the scores S = s * Q^ K^^T: exp(min(logit_scale[h], ln 100)) for
    cosine attention (precomputed by the host), ``scale`` for V1."""
    if COSINE:
        return tl.load(head_scale_ptr + h).to(tl.float32)
    else:
        return scale


@triton.jit
def load_bias_mask(bias_ptr, mask_ptr, h, w, rows, cols,
                   stride_bias_h, stride_bias_i, stride_bias_j,
                   stride_mask_w, stride_mask_i, stride_mask_j,
                   N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(B[h] + M[w]) * log2(e) for one (rows, cols) tile, fp32; -inf on padded columns."""
    inside = (rows[:, None] < N) & (cols[None, :] < N)
    bm = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if HAS_BIAS:
        ptrs = bias_ptr + h * stride_bias_h + rows[:, None] * stride_bias_i + cols[None, :] * stride_bias_j
        bm += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        ptrs = mask_ptr + w * stride_mask_w + rows[:, None] * stride_mask_i + cols[None, :] * stride_mask_j
        bm += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    bm = bm * LOG2E
    return tl.where(cols[None, :] < N, bm, float("-inf"))
