"""Host time of one compiled launch, each kernel alone: ours against inductor's own.

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/launch_alone.py [--static]

Compiles one window-attention call, forward and backward (B_ 1024, N 49, 4 heads of 32, bf16,
a dense bias; ``--static``: with inductor's ``static_launch_user_defined_triton_kernels``),
captures the arguments of every kernel's ``CachingAutotuner.run`` in one more step, then
times each kernel's ``run`` and its launcher alone with those arguments: 5 rounds of 200
launches back to back after 20, the best round, us per launch. Prints each kernel's
compile result type (``StaticTritonCompileResult``: inductor's static launcher launches
it). Unlike ``launch_host.py`` (each launch within a step), this isolates the launch path's
own cost from a busy host's. GPU only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from launch_host import autotuners, kernel_name  # noqa: E402
from timm_flashwin.ops.window import window_attention  # noqa: E402

B, N, H, D = 1024, 49, 4, 32


def us_per_launch(fn, rounds: int = 5, launches: int = 200) -> float:
    """The best round's host us per call of ``fn``, after 20 calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(launches):
            fn()
        best = min(best, (time.perf_counter() - start) / launches)
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--static", action="store_true", help="static_launch_user_defined_triton_kernels=True")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(H, N, N, device="cuda", dtype=torch.float32, requires_grad=True)

    def loss(qkv, bias):
        return window_attention(qkv, H, bias=bias, scale=D ** -0.5).float().square().sum()
    with inductor_config.patch(static_launch_user_defined_triton_kernels=args.static):
        compiled = torch.compile(loss)
        for _ in range(3):
            compiled(qkv, bias).backward()
    torch.cuda.synchronize()
    caught, tuners = {}, autotuners()
    for tuner in tuners:
        def capture(*a, _run=tuner.run, _tuner=tuner, **k):
            caught[id(_tuner)] = (a, k)
            return _run(*a, **k)
        tuner.run = capture
    compiled(qkv, bias).backward()
    torch.cuda.synchronize()
    for tuner in tuners:
        del tuner.run
    for tuner in tuners:
        if id(tuner) not in caught:
            continue
        a, k = caught[id(tuner)]
        launcher = tuner.launchers[0]
        run_us = us_per_launch(lambda: tuner.run(*a, **k))
        launcher_us = us_per_launch(lambda: launcher(*a, **k))
        print(f"{kernel_name(tuner):42s} run {run_us:6.1f} us, launcher {launcher_us:6.1f} us; {len(a)} args "
              f"({sum(hasattr(x, 'data_ptr') for x in a)} tensors); "
              f"{', '.join(type(r).__name__ for r in getattr(tuner, 'compile_results', []))}", flush=True)


if __name__ == "__main__":
    main()
