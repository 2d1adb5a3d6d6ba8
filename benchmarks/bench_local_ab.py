"""Times the local-attention operators on a few fixed cases with whatever ``timm_flashwin``
is first on the path, and prints one JSON line: for comparing two versions of the kernels in
alternating runs on one GPU (a GPU's pace drifts between runs more than a small change moves
it). Each case: median of 5 rounds of 10 calls, bf16, the forward (no gradient) and the
forward + backward.

    git archive OLD | tar -x -C /tmp/old
    for i in 1 2 3; do
        python benchmarks/bench_local_ab.py new
        (cd /tmp/old && PYTHONPATH=/tmp/old python $OLDPWD/benchmarks/bench_local_ab.py old)
    done > results/local_ab.jsonl

GPU only.
"""
import json
import statistics
import sys

import torch
from common import gpu_ms_per_call  # benchmarks/, the script's folder: first on the path

from timm_flashwin import block_sliding_window_attention as bswa
from timm_flashwin import sliding_window_attention as swa

#: name: (call, (B, H, S, D))
CASES = {
    "causal_d64_S16k": (lambda q, k, v: swa(q, k, v, causal=True), (2, 16, 16384, 64)),
    "window512_d128_S16k": (lambda q, k, v: swa(q, k, v, window=(512, 512)), (1, 16, 16384, 128)),
    "frames256_w16_S32k": (lambda q, k, v: bswa(q, k, v, block_size=256, window_blocks=16), (1, 12, 32768, 64)),
    "global_d128_S8k": (lambda q, k, v: swa(q, k, v), (2, 16, 8192, 128)),
    "window256_d64_S16k": (lambda q, k, v: swa(q, k, v, window=(256, 256)), (2, 16, 16384, 64)),
    "causal_w1024_d64_S16k": (lambda q, k, v: swa(q, k, v, window=(1024, 0), causal=True), (2, 16, 16384, 64)),
    "window128_d64_S4k": (lambda q, k, v: swa(q, k, v, window=(64, 63)), (8, 16, 4096, 64)),
}


def median_ms(fn, rounds: int = 5, calls: int = 10) -> float:
    """GPU ms per call of ``fn``: the median of ``rounds`` rounds of ``calls`` calls, after 3."""
    for _ in range(3):
        fn()
    return statistics.median(gpu_ms_per_call(fn, calls) for _ in range(rounds))


def main() -> None:
    torch.manual_seed(0)
    results = {}
    for name, (call, (batch, heads, length, head_dim)) in CASES.items():
        q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def forward():
            with torch.no_grad():
                call(q, k, v)

        def forward_backward():
            call(q, k, v).backward(grad)

        results[name] = {"fwd": median_ms(forward), "fwdbwd": median_ms(forward_backward)}
    print(json.dumps({"code": sys.argv[1] if len(sys.argv) > 1 else "", "ms": results}), flush=True)


if __name__ == "__main__":
    main()
