"""The float16 copy of the bias, times log2(e), that the kernels streaming key blocks read
with 16-bit inputs (``launch.streamed_bias`` says why): one pass, strided (H, N, N) in,
contiguous out."""
import triton
import triton.language as tl

from .tiles import LOG2E


@triton.jit
def float16_bias_copy_kernel(
    bias_ptr, out_ptr, numel, n, stride_h, stride_i, stride_j,
    BLOCK: tl.constexpr,
):
    """Grid: (H*N*N / BLOCK,). out[h, i, j] = float16(bias[h, i, j] * log2(e)) (the kernels'
    logits are in the log2 domain: they then add it as it is), except that a finite value
    the cast rounds to +-inf (|bias| beyond 65504 / log2(e) = 45403) becomes NaN: its rows
    then come out NaN, not silently different. +-inf and NaN stay what they are."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    h = offs // (n * n)
    i = (offs // n) % n
    j = offs % n
    x = tl.load(bias_ptr + h * stride_h + i * stride_i + j * stride_j, mask=inside, other=0.0)
    y = (x.to(tl.float32) * LOG2E).to(tl.float16)
    overflow = (tl.abs(y.to(tl.float32)) == float("inf")) & (tl.abs(x) != float("inf"))
    tl.store(out_ptr + offs, tl.where(overflow, float("nan"), y.to(tl.float32)).to(tl.float16), mask=inside)
