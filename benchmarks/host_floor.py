"""The op's own host time per call, measured on a CPU with its kernel launches stubbed.

    python benchmarks/host_floor.py [--top 20] [--out results/host_floor.json]

What a host-bound eager step pays per attention call besides the launches themselves:
``window_attention``'s Python (validation, launch plan, allocations, the autograd node) in
the eager road the GPU takes (direct launches, ``_EagerWindowAttention``), on CPU tensors
with ``TRITON_INTERPRET=1`` and every Triton launch replaced by a no-op, so that no kernel
runs and no GPU is needed. Small windows (4 windows of 7x7, 3 heads of 32), V1 with timm's
bias table read through its index and a shift mask, as the Swin adapters call the op.

Rows, us per call (the median of 9 alternating rounds of 200 calls of each row): the
forward's Python up to the host program that replays it on a GPU (the replay stubbed: what
a replayed call pays before C++ takes over); ``sliding_window_attention`` (causal; B 2,
H 16, S 256, D 64) forward without autograd and forward + backward; the window op's forward
without and with autograd, the backward alone (``torch.autograd.grad`` on a kept graph),
forward + backward, and the same forward + backward of a trivial ``torch.autograd.Function``
with the op's inputs and output shapes (empty tensors out, nothing computed): the floor that
any Python autograd operator pays in torch's machinery; and one ATen operator (a multiply of
one element) forward + backward through ``torch.autograd.grad``: the floor of any operator
with a C++ autograd node, such as a replayed host program. (``bench_dispatch.py`` stubs the
launchers whole to compare the two roads to them.) The launches this leaves out cost 10 to
30 us each on a GPU host (benchmarks/bench_launch.py). Timings depend on the CPU: compare
rows of one run.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels' CPU road

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_dispatch import alternating_us_per_call  # noqa: E402
from bench_op import timm_mask  # noqa: E402
from bench_op_loop import relative_position_index  # noqa: E402
from common import code_version, write_json  # noqa: E402
from timm_flashwin import TableBias, sliding_window_attention, window_attention
from timm_flashwin.ops import host_program  # noqa: E402
from timm_flashwin.kernels import launcher  # noqa: E402

WINDOWS, HEADS, TOKENS, HEAD_DIM, WINDOW = 4, 3, 49, 32, 7


class _Trivial(torch.autograd.Function):
    """The op's inputs and output shape, nothing computed: torch's autograd floor."""

    @staticmethod
    def forward(ctx, qkv, table):
        ctx.save_for_backward(qkv, table)
        return qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)

    @staticmethod
    def backward(ctx, grad_out):
        qkv, table = ctx.saved_tensors
        return torch.empty_like(qkv), torch.empty_like(table)


def _up_to_host_program(forward, out):
    """``forward``'s Python before a host program replays it (validation, the road's
    decisions, the signature key): ``host_program.takes`` answers yes, ``call`` returns
    ``out`` at once."""
    def run():
        takes, call = host_program.takes, host_program.call
        host_program.takes, host_program.call = (lambda tensor: True), (lambda *args, **kwargs: out)
        try:
            forward()
        finally:
            host_program.takes, host_program.call = takes, call
    return run


def calls():
    qkv = torch.randn(WINDOWS, TOKENS, 3 * HEADS * HEAD_DIM, requires_grad=True)
    table = torch.randn((2 * WINDOW - 1) ** 2, HEADS, requires_grad=True)
    bias = TableBias(table, relative_position_index(WINDOW), constant_index=True)
    mask = timm_mask(WINDOWS, TOKENS, "cpu")
    grad_out = torch.randn(WINDOWS, TOKENS, HEADS * HEAD_DIM)

    def forward():
        return window_attention(qkv, HEADS, bias=bias, mask=mask, scale=HEAD_DIM ** -0.5)

    def forward_no_grad():
        with torch.no_grad():
            forward()

    q, k, v = (torch.randn(2, 16, 256, 64, requires_grad=True) for _ in range(3))
    grad_local = torch.randn_like(q)

    def causal():
        return sliding_window_attention(q, k, v, window=(None, 0))

    def causal_no_grad():
        with torch.no_grad():
            causal()

    element, grad_element = torch.ones(1, requires_grad=True), torch.ones(1)
    kept = forward()
    return {
        "forward up to its host program (replay stubbed)": _up_to_host_program(forward, kept),
        "sliding_window_attention causal, forward, no grad": causal_no_grad,
        "sliding_window_attention causal, forward + backward":
            lambda: torch.autograd.grad(causal(), (q, k, v), grad_local),
        "forward, no grad": forward_no_grad,
        "forward": forward,
        "backward": lambda: torch.autograd.grad(kept, (qkv, table), grad_out, retain_graph=True),
        "forward + backward": lambda: torch.autograd.grad(forward(), (qkv, table), grad_out),
        "trivial autograd.Function, forward + backward":
            lambda: torch.autograd.grad(_Trivial.apply(qkv, table), (qkv, table), grad_out),
        "one ATen op on one element, forward + backward":
            lambda: torch.autograd.grad(element.mul(2.0), element, grad_element),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (medians)")
    parser.add_argument("--top", type=int, default=0, help="also print cProfile's N largest own times of f+b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    launcher._Launcher.__getitem__ = lambda self, grid: (lambda *a, **k: None)  # every launch a no-op
    rows = alternating_us_per_call(calls(), 200, args.rounds)
    for name, us in rows.items():
        print(f"{name:52s} {us:8.1f} us")
    if args.top:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        fn = calls()["forward + backward"]
        profiler.enable()
        for _ in range(300):
            fn()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    if args.out:
        write_json(args.out, dict(code=code_version(), torch=torch.__version__, us_per_call=rows))


if __name__ == "__main__":
    main()
