"""One Swin block's window attention (timm's ``_attn``: roll, partition, attention module,
merge, roll back) three ways: timm's, the patched module inside timm's method
(``patch_model(..., feature_map=False)``), and the op reading the windows in place
(``patch_model``), and that with the V1 / SwinV2 bias gathered before the op
(``flashwin-gathered-bias``, as before the kernels read its table). GPU kernel time per call (every kernel summed, from torch.profiler:
the shuffles' copies included, the host's launch time left out) and wall time per call
(host included), forward alone (no_grad) and forward + backward, under AMP bf16.

    python benchmarks/bench_feature_map.py --out results/feature_map.json

Shapes: swin_tiny's four stages at the training batch of 64 (56x56 x 96 channels, 3 heads,
down to 7x7 x 768, 24 heads), the shifted block of each stage (the last stage's window
covers its map: no shift), and SwinV2-tiny's first stage (64x64, window 8).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import timm
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, cuda_kernel_times, gathered_bias, host_us_per_call, write_json  # noqa: E402
from timm_flashwin import patch_model  # noqa: E402

#: (model, stage, block, batch)
BLOCKS = [("swin_tiny_patch4_window7_224", stage, 1, 64) for stage in range(4)] + [
    ("swinv2_tiny_window8_256", 0, 1, 64)]
VARIANTS = ("timm", "flashwin-partitioned", "flashwin", "flashwin-gathered-bias")


def block_of(model: torch.nn.Module, stage: int, index: int) -> torch.nn.Module:
    return model.layers[stage].blocks[index]


def gpu_and_wall_us(fn, calls: int = 30):
    """(GPU kernel us, wall us) per call of ``fn``."""
    wall = host_us_per_call(fn, calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(us for _, us in cuda_kernel_times(prof).values()) / calls, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, stage, index, batch in BLOCKS:
        base = timm.create_model(name).cuda().train()
        size = base.pretrained_cfg["input_size"][1:]
        shapes = []
        hook = block_of(base, stage, index).register_forward_pre_hook(lambda m, a: shapes.append(a[0].shape))
        with torch.no_grad():
            base(torch.randn(1, 3, *size, device="cuda"))
        hook.remove()
        _, height, width, channels = shapes[0]
        x = torch.randn(batch, height, width, channels, device="cuda")
        for variant in args.variants:
            model = copy.deepcopy(base)
            if variant != "timm":
                patch_model(model, feature_map=variant != "flashwin-partitioned")
            block = block_of(model, stage, index)
            attend = block._shifted_window_attn if hasattr(block, "_shifted_window_attn") else block._attn
            xg = x.clone().requires_grad_()

            def forward():
                with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                    attend(x)

            def forward_backward():
                with torch.autocast("cuda", torch.bfloat16):
                    out = attend(xg)
                out.backward(torch.ones_like(out))

            if variant == "flashwin-gathered-bias":
                forward, forward_backward = gathered_bias(forward), gathered_bias(forward_backward)
            fwd_gpu, fwd_wall = gpu_and_wall_us(forward)
            fb_gpu, fb_wall = gpu_and_wall_us(forward_backward)
            row = dict(model=name, stage=stage, block=index, batch=batch, map=[height, width], channels=channels,
                       window=list(block.window_size), shift=list(block.shift_size), variant=variant,
                       fwd_gpu_us=fwd_gpu, fwd_wall_us=fwd_wall, fwd_bwd_gpu_us=fb_gpu, fwd_bwd_wall_us=fb_wall,
                       device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version())
            rows.append(row)
            print(f"{name} stage {stage} ({height}x{width}x{channels}, shift {tuple(block.shift_size)}) "
                  f"{variant:22s} fwd {fwd_gpu:7.1f} us GPU {fwd_wall:7.1f} wall | f+b {fb_gpu:7.1f} GPU "
                  f"{fb_wall:7.1f} wall", flush=True)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
