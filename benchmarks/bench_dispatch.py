"""Host cost of calling the op, the kernels left out: the registered operator against
the eager path (``op._EagerWindowAttention``), forward and forward + backward.

    python benchmarks/bench_dispatch.py [--calls 2000] [--out results/dispatch.json]

The kernel launchers (``attention_forward`` / ``attention_backward``) are replaced by
stubs that return preallocated outputs, so both paths do the same work but for what lies
between ``window_attention`` and the launchers: custom-op dispatch, autograd wrapping,
wrap_triton switching. Runs on the CPU (no GPU, no interpreter): it measures Python and
dispatcher time, which is what an eager, launch-bound training step pays per layer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import write_json  # noqa: E402
from timm_flashwin.ops import window as op  # noqa: E402


def stub_launchers(num_windows: int, n: int, channels: int, heads: int):
    out = torch.zeros(num_windows, n, channels // 3)
    stats, regions, info = torch.empty(0), torch.empty(0, dtype=torch.int32), torch.empty(0)
    dqkv, dbias = torch.zeros(num_windows, n, channels), torch.zeros(heads, n, n)

    def forward(*args, **kwargs):
        return out.clone(), stats.clone(), regions.clone(), info.clone()

    def backward(*args, **kwargs):
        return dqkv.clone(), dbias.clone(), torch.empty(0)

    op.attention_forward, op.attention_backward = forward, backward


def alternating_us_per_call(fns: dict, calls: int, rounds: int) -> dict:
    """us per call of each function (name -> fn), after 50 warm-up calls of each: ``rounds``
    rounds, each timing ``calls`` calls of every function in turn; the medians. A CPU whose
    pace drifts between seconds (a row read 37 and 81 us in two runs a minute apart) then
    moves every row of a round alike."""
    for fn in fns.values():
        for _ in range(50):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def us_per_call(fn, calls: int, rounds: int = 5) -> float:
    """us per call of ``fn``: the median of ``rounds`` rounds of ``calls`` calls."""
    return alternating_us_per_call({"fn": fn}, calls, rounds)["fn"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    heads, n, head_dim, num_windows = 3, 16, 16, 4  # small: the stubs cost next to nothing
    stub_launchers(num_windows, n, 3 * heads * head_dim, heads)
    qkv = torch.randn(num_windows, n, 3 * heads * head_dim, requires_grad=True)
    bias = torch.randn(heads, n, n, requires_grad=True)
    mask = torch.zeros(num_windows, n, n)
    inputs = (qkv, heads, bias, mask, None, head_dim ** -0.5, False, 0.0, None, True)
    # the eager Function also takes the feature-map grid and the table gather (None: partitioned windows, dense bias)
    paths = {"operator": op.window_attention_fwd,
             "eager autograd.Function": lambda *args: op._EagerWindowAttention.apply(*args, None, None, None, False)}
    rows = []
    for name, forward in paths.items():
        def infer():
            with torch.inference_mode():
                forward(*inputs)

        def train():
            forward(*inputs)[0].backward(torch.ones(num_windows, n, heads * head_dim))

        row = dict(path=name, forward_us=us_per_call(infer, args.calls), forward_backward_us=us_per_call(train, args.calls))
        rows.append(row)
        print(f"{name:26s} forward {row['forward_us']:6.1f} us   forward+backward {row['forward_backward_us']:6.1f} us")
    if args.out:
        write_json(args.out, dict(torch=torch.__version__, cpu=os.cpu_count(), rows=rows))


if __name__ == "__main__":
    main()
