"""The float16 copy of bias + mask, times log2(e), that the kernels streaming key blocks read
with 16-bit inputs (``bias_mask.streamed_bias`` says why): one pass, strided (H, N, N) bias and
(nW, N, N) mask in, contiguous (nW, H, N, N) out."""
import triton
import triton.language as tl

from .tiles import LOG2E

FLOAT16_LOWEST = tl.constexpr(-65504.0)


@triton.jit
def float16_bias_copy_kernel(
    bias_ptr, mask_ptr, out_ptr, numel, n, heads,
    stride_h, stride_i, stride_j, stride_mask_w, stride_mask_i, stride_mask_j,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid: (nW*H*N*N / BLOCK,). out[w, h, i, j] = float16((bias[h, i, j] + mask[w, i, j]) *
    log2(e)) (the kernels' logits are in the log2 domain: they then add it as it is), a
    missing bias or mask counting 0. A finite sum beyond float16's range (|x| > 65504 /
    log2(e) = 45403) becomes NaN where it is positive: its rows then come out NaN, not
    silently different; where it is negative (masks of -1e9 and the like) float16's lowest,
    -65504: a probability of 0 next to any logit within range, as it is in float32, and
    a row of nothing else averages its values, as float32 does (-1e9 + b rounds to -1e9
    there). +-inf and NaN stay what they are."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    j = offs % n
    i = (offs // n) % n
    h = (offs // (n * n)) % heads
    w = offs // (n * n * heads)
    x = tl.zeros((BLOCK,), tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + h * stride_h + i * stride_i + j * stride_j, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        x += tl.load(mask_ptr + w * stride_mask_w + i * stride_mask_i + j * stride_mask_j, mask=inside,
                     other=0.0).to(tl.float32)
    y = (x * LOG2E).to(tl.float16).to(tl.float32)
    overflow = (tl.abs(y) == float("inf")) & (tl.abs(x) != float("inf"))
    y = tl.where(overflow, tl.where(x < 0, FLOAT16_LOWEST, float("nan")), y)
    tl.store(out_ptr + offs, y.to(tl.float16), mask=inside)
