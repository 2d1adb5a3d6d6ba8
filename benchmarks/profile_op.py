"""GPU time per kernel of one implementation's forward+backward (or, with --forward, its
forward) in bench_op.py.

    python benchmarks/profile_op.py --shapes v1_s3_b64 w24_s1_b16 --impl ours [--forward] --out results/p.json

Runs bench_op's case as bench_op times it (inputs, the table gather, bf16 autocast, the
gradients to qkv, table and logit scale; the forward under no_grad) a few times under
torch.profiler and lists every CUDA kernel with its time per call: what bench_op's cell
is made of. GPU only.

With --ncu, for Nsight Compute instead: a few warm-up steps (compilation, caches), then
one step between cudaProfilerStart and cudaProfilerStop, for example

    ncu --profile-from-start off --clock-control none --set full -k regex:dkdv \
        -o w16 python benchmarks/profile_op.py --shapes w16_s1_b32 --kinds v1 --ncu

(one shape and kind per run; --clock-control none leaves the clocks as they run).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_op import SHAPES, implementation, leaves_of, make_inputs, timed_passes  # noqa: E402
from common import code_version, cuda_kernel_times, write_json  # noqa: E402


def profile_case(shape_name: str, kind: str, impl: str, steps: int, forward_only: bool = False, ncu: bool = False):
    from torch.profiler import ProfilerActivity, profile
    inp = make_inputs(SHAPES[shape_name], kind == "cosine")
    forward, forward_backward = timed_passes(implementation(impl), inp)

    def step():
        if forward_only:
            forward()
            return
        forward_backward()
        for t in leaves_of(inp):
            t.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if ncu:
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = cuda_kernel_times(prof)
    rows = [dict(kernel=name[:140], calls=c / steps, us=t / steps)
            for name, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["v1_s3_b64"])
    parser.add_argument("--kinds", nargs="*", default=["v1", "cosine"])
    parser.add_argument("--impl", default="ours")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--forward", action="store_true", help="the forward alone, as bench_op times it (no_grad)")
    parser.add_argument("--ncu", action="store_true",
                        help="one step between cudaProfilerStart/Stop, for ncu --profile-from-start off")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for shape_name, kind in itertools.product(args.shapes, args.kinds):
        rows = profile_case(shape_name, kind, args.impl, args.steps, args.forward, args.ncu)
        if args.ncu:
            continue
        total = sum(r["us"] for r in rows)
        what = "forward (no_grad)" if args.forward else "forward+backward"
        print(f"{shape_name} {kind} {args.impl}: {total:.1f} us of kernels per {what}", flush=True)
        for r in rows:
            print(f"  {r['us']:8.1f} us {r['calls']:4.0f}x  {r['kernel'][:100]}")
        results.append(dict(shape=shape_name, kind=kind, impl=args.impl, forward_only=args.forward,
                            kernel_us=total, kernels=rows,
                            device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version()))
        if args.out:
            write_json(args.out, results)


if __name__ == "__main__":
    main()
