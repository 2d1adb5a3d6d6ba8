"""Host time of the op's launches: what an eager step pays per layer before the GPU works.

    python benchmarks/bench_launch.py --out results/launch.json

For a few windows (the GPU finishes each kernel long before the host enqueues the next),
the wall time per call, averaged over many calls with one synchronization at the end:
the forward kernel's launch through ``kernel[grid](...)`` (Triton binds and specializes
its arguments at each launch), the same compiled kernel called directly, and the public
op's forward (no gradient) and forward + backward, with ``kernels.fast_launch`` on and
off, alternated. GPU only.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, host_us_per_call, write_json  # noqa: E402
from timm_flashwin import window_attention  # noqa: E402
from timm_flashwin.kernels import fast_launch  # noqa: E402
from timm_flashwin.kernels.window.forward import window_attention_fwd_kernel  # noqa: E402
from timm_flashwin.ops.dispatch import direct_launches  # noqa: E402

#: name: (windows, heads, N, head_dim, mask windows)
CASES = {"w7": (16, 3, 49, 32, 4), "w24": (4, 4, 576, 32, 4)}


def us_per_call(fn, calls: int) -> float:
    return host_us_per_call(fn, calls, warmup=20)


def op_inputs(windows, heads, n, head_dim, mask_windows, cosine, grad):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(windows, n, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(heads, n, n, device="cuda", generator=g)
    mask = torch.zeros(mask_windows, n, n, device="cuda")
    mask[1:, : n // 2, n // 2:] = -100.0
    logit_scale = torch.randn(heads, device="cuda", generator=g) if cosine else None
    for t in (qkv, bias, logit_scale):
        if t is not None:
            t.requires_grad_(grad)
    return dict(qkv=qkv, num_heads=heads, bias=bias, mask=mask, scale=None if cosine else head_dim ** -0.5,
                logit_scale=logit_scale)


def kernel_launch_times(calls: int) -> dict:
    """The forward kernel's launch through Triton against the compiled kernel called directly."""
    captured = {}
    real_run = window_attention_fwd_kernel.run

    def spy(*args, grid, warmup, **kwargs):
        captured.update(args=args, grid=grid, kwargs=kwargs)
        return real_run(*args, grid=grid, warmup=warmup, **kwargs)

    inputs = op_inputs(*CASES["w7"], cosine=False, grad=False)
    window_attention_fwd_kernel.run = spy
    try:
        with torch.no_grad(), direct_launches():
            fast_launch.ENABLED = False
            window_attention(**inputs)
    finally:
        window_attention_fwd_kernel.run = real_run
        fast_launch.ENABLED = True
    args, grid, kwargs = captured["args"], captured["grid"], captured["kwargs"]
    compiled = real_run(*args, grid=grid, warmup=False, **kwargs)
    constexprs = tuple(kwargs[name] for name in window_attention_fwd_kernel.arg_names[len(args):])
    through_triton = window_attention_fwd_kernel[grid]
    return {
        "triton launch (kernel[grid](...))": us_per_call(lambda: through_triton(*args, **kwargs), calls),
        "compiled kernel called directly": us_per_call(lambda: compiled[(*grid, 1, 1)[:3]](*args, *constexprs), calls),
        "fast_launch.launch": us_per_call(lambda: fast_launch.launch(window_attention_fwd_kernel, grid, args, kwargs,
                                                                     torch.cuda.current_device()),
                                          calls),
        "arguments": len(args) + len(kwargs),
    }


def op_times(case: str, cosine: bool, calls: int, rounds: int) -> dict:
    """Forward (no gradient) and forward + backward of the public op, fast_launch on / off."""
    infer = op_inputs(*CASES[case], cosine=cosine, grad=False)
    train = op_inputs(*CASES[case], cosine=cosine, grad=True)
    grad_out = torch.ones(1, device="cuda")

    def forward():
        with torch.no_grad():
            window_attention(**infer)

    def forward_backward():
        out = window_attention(**train)
        out.backward(grad_out.expand_as(out))

    times = {}
    for _ in range(rounds):
        for enabled in (True, False):
            fast_launch.ENABLED = enabled
            for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                times.setdefault(f"{name}, fast_launch {'on' if enabled else 'off'}", []).append(us_per_call(fn, calls))
    fast_launch.ENABLED = True
    return {k: sum(v) / len(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "code": code_version(),
               "triton": __import__("triton").__version__, "kernel launch, us": kernel_launch_times(args.calls)}
    for name, value in results["kernel launch, us"].items():
        print(f"{name:40s} {value:8.1f}")
    for case in CASES:
        for cosine in (False, True):
            label = f"{case} {'cosine' if cosine else 'v1'}, us per call"
            results[label] = op_times(case, cosine, args.calls, args.rounds)
            for name, value in results[label].items():
                print(f"{label:28s} {name:36s} {value:8.1f}")
            if args.out:
                write_json(args.out, results)


if __name__ == "__main__":
    main()
