"""SwinV2's cpb_mlp: our one-kernel forward and backward against PyTorch's layers, eager and
compiled, GPU time per call (forward alone, forward + backward), and a sweep of the kernels'
tiles.

    python benchmarks/bench_position_mlp.py --out results/position_mlp.json [--sweep]

Shapes: the tables of windows 8, 12, 16 and 24 ((2w - 1)^2 rows), 512 hidden units, the
heads of SwinV2-base's last stage (32) and of SwinV2-tiny's first (3). GPU time from the
kernels' CUDA events under torch.profiler (the host's launch time left out: the steps that
call these are host-bound, and what the kernels save there is measured by
profile_step.py). With --sweep, every (BLOCK_T, BLOCK_K, warps) of a small grid for our
kernels on windows 8 and 24, the forward and the backward each, printed and in the JSON.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, cuda_kernel_times, write_json  # noqa: E402
from timm_flashwin.kernels.position import launch as launch  # noqa: E402
from timm_flashwin.ops.position_mlp import position_mlp_table  # noqa: E402

SHAPES = [(w, heads) for w in (8, 12, 16, 24) for heads in (3, 32)]
HIDDEN = 512


def timm_layers(coords, w1, b1, w2):
    return F.linear(F.relu(F.linear(coords, w1, b1)), w2)


def gpu_us(fn, calls: int = 50) -> float:
    """GPU kernel us per call of ``fn`` (every kernel it launches, summed)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(us for _, us in cuda_kernel_times(prof).values()) / calls


def inputs(window: int, heads: int, dtype=torch.float32):
    rows = (2 * window - 1) ** 2
    g = torch.Generator().manual_seed(0)
    coords = 8 * torch.rand(rows, 2, generator=g) - 4
    params = [torch.randn(HIDDEN, 2, generator=g), torch.randn(HIDDEN, generator=g),
              torch.randn(heads, HIDDEN, generator=g) / HIDDEN ** 0.5]
    return coords.cuda(), [p.to(dtype).cuda().requires_grad_() for p in params], torch.randn(rows, heads).cuda()


def passes(fn, coords, params, grad):
    def forward():
        with torch.no_grad():
            fn(coords, *params)

    def forward_backward():
        fn(coords, *params).backward(grad)
    return forward, forward_backward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    compiled = torch.compile(timm_layers)
    rows = []
    for window, heads in SHAPES:
        coords, params, grad = inputs(window, heads)
        row = dict(window=window, heads=heads, rows=coords.shape[0], hidden=HIDDEN,
                   device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version())
        for name, fn in (("pytorch", timm_layers), ("compiled", compiled), ("ours", position_mlp_table)):
            forward, forward_backward = passes(fn, coords, params, grad)
            row[name] = dict(forward_us=gpu_us(forward), forward_backward_us=gpu_us(forward_backward))
        print(f"w{window:2d} H{heads:2d} ({coords.shape[0]:4d} rows): " + "  ".join(
            f"{name} {row[name]['forward_us']:6.1f} / {row[name]['forward_backward_us']:6.1f} us"
            for name in ("pytorch", "compiled", "ours")), flush=True)
        if args.sweep and window in (8, 24):
            row["sweep"] = []
            defaults = launch._MLP_FORWARD, launch._MLP_BACKWARD
            for block_t, block_k, warps in itertools.product((16, 32, 64), (32, 64, 128), (2, 4, 8)):
                launch._MLP_FORWARD = launch._MLP_BACKWARD = block_t, block_k, warps
                forward, forward_backward = passes(position_mlp_table, coords, params, grad)
                fwd, both = gpu_us(forward, 20), gpu_us(forward_backward, 20)
                row["sweep"].append(dict(block_t=block_t, block_k=block_k, warps=warps, forward_us=fwd,
                                         backward_us=both - fwd))
            launch._MLP_FORWARD, launch._MLP_BACKWARD = defaults
            for part in ("forward_us", "backward_us"):
                best = min(row["sweep"], key=lambda r: r[part])
                print(f"    best {part[:-3]}: {best[part]:6.1f} us at BLOCK_T {best['block_t']}, BLOCK_K "
                      f"{best['block_k']}, {best['warps']} warps", flush=True)
        rows.append(row)
        if args.out:
            write_json(args.out, rows)


if __name__ == "__main__":
    main()
