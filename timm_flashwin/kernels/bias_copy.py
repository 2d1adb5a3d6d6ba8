"""The float16 copy of a float32 bias that the kernels streaming key blocks read
(``launch.streamed_bias`` says why): one pass, strided (H, N, N) in, contiguous out."""
import triton
import triton.language as tl


@triton.jit
def float16_bias_copy_kernel(
    bias_ptr, out_ptr, numel, n, stride_h, stride_i, stride_j,
    BLOCK: tl.constexpr,
):
    """Grid: (H*N*N / BLOCK,). out[h, i, j] = float16(bias[h, i, j]), except that a finite
    value the cast rounds to +-inf (beyond 65504) becomes NaN: its rows then come out NaN,
    not silently different. +-inf and NaN stay what they are."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    h = offs // (n * n)
    i = (offs // n) % n
    j = offs % n
    x = tl.load(bias_ptr + h * stride_h + i * stride_i + j * stride_j, mask=inside, other=0.0)
    y = x.to(tl.float16)
    overflow = (tl.abs(y.to(tl.float32)) == float("inf")) & (tl.abs(x) != float("inf"))
    tl.store(out_ptr + offs, tl.where(overflow, float("nan"), y.to(tl.float32)).to(tl.float16), mask=inside)
