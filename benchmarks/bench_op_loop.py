"""The op in a plain loop against its CUDA-graph replay: how much of a call the host adds.

    python benchmarks/bench_op_loop.py --out results/op_loop.json

For bench_op.py's shapes, V1 (the bias a ``TableBias``, as the V1 adapter hands it) and
cosine (a ``TableBias`` with SwinV2's sigmoid), timm's shift mask: forward + backward
(``torch.autograd.grad`` to qkv, the table and the logit scale: no accumulation into leaf
gradients, which a model's step does not have for qkv) per call (``--no-grad``: the
forward alone, as inference calls it); ``--compile``: the op's call compiled
(``torch.compile``, default mode, fullgraph), its backward the compiled graph's:

* ``graph us``: CUDA-graph replays of one call (the GPU's time alone);
* ``loop us``: calls back to back in a Python loop, synchronized once at the end (what a
  training step pays per call where the host is the bound);
* ``host us``: one call's host time with the GPU idle when it starts.

``loop / graph`` near 1 means the GPU sets the pace; above, the host does. Alternating
rounds of each case's three measurements, median. GPU only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_op import SHAPES, timm_mask  # noqa: E402
from common import code_version, enqueue_us, host_us_per_call, python_profile, write_json  # noqa: E402
from timm_flashwin import TableBias, window_attention
from timm_flashwin.ops import host_program  # noqa: E402


def relative_position_index(window: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def make_call(shape, kind: str, grad: bool = True, compiled: bool = False):
    """One forward + backward of the op on ``shape`` (bench_op's (B_, H, N, D, nW)); without
    ``grad``, one forward under torch.no_grad (inference); ``compiled``: the op's call under
    torch.compile."""
    num_windows, heads, n, head_dim, periods = shape
    window = int(round(n ** 0.5))
    device = "cuda"
    qkv = torch.randn(num_windows, n, 3 * heads * head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    table = torch.randn((2 * window - 1) ** 2, heads, device=device, requires_grad=True)
    index = relative_position_index(window).to(device)
    mask = timm_mask(periods, n, device) if periods else None  # nW 0: no shift mask (bench_op's other families)
    grad_out = torch.randn(num_windows, n, heads * head_dim, device=device, dtype=torch.bfloat16)
    if kind == "v1":
        bias, score, leaves = TableBias(table, index, constant_index=True), dict(scale=head_dim ** -0.5), (qkv, table)
    else:
        logit_scale = torch.full((heads, 1, 1), 2.0, device=device, requires_grad=True)
        bias = TableBias(table, index, 16.0, constant_index=True)
        score, leaves = dict(logit_scale=logit_scale), (qkv, table, logit_scale)

    attention = torch.compile(window_attention, fullgraph=True) if compiled else window_attention

    def call():
        out = attention(qkv, heads, bias=bias, mask=mask, **score)
        torch.autograd.grad(out, leaves, grad_out)

    def forward():
        with torch.no_grad():
            attention(qkv, heads, bias=bias, mask=mask, **score)
    return call if grad else forward


def graph_us(call, replays: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "w12_s1_b32"], choices=list(SHAPES))
    parser.add_argument("--kinds", nargs="*", default=["v1", "cosine"], choices=["v1", "cosine"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-programs", choices=["on", "off", "both"], default="on",
                        help="replay recorded host programs (timm_flashwin.ops.host_program); both: each case "
                             "both ways in alternating rounds, two rows")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N Python functions with the most own time over 200 calls of each case")
    parser.add_argument("--no-grad", action="store_true", help="the forward alone, under torch.no_grad")
    parser.add_argument("--compile", action="store_true",
                        help="the op's call compiled (torch.compile, default mode; host programs do not apply)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.host_programs]
    print(f"{'shape':12s} {'kind':7s} {'programs':8s} {'graph us':>9s} {'loop us':>9s} {'host us':>9s} "
          f"{'loop/graph':>10s}", flush=True)
    for name in args.shapes:
        for kind in args.kinds:
            call = make_call(SHAPES[name], kind, grad=not args.no_grad, compiled=args.compile)
            measured = {on: {"graph": [], "loop": [], "host": []} for on in settings}
            for on in settings:  # the first calls record the host program
                host_program.ENABLED = on
                for _ in range(5):
                    call()
            for _ in range(args.rounds):
                for on in settings:
                    host_program.ENABLED = on
                    measured[on]["graph"].append(graph_us(call))
                    measured[on]["loop"].append(host_us_per_call(call, 100, warmup=0))
                    measured[on]["host"].append(enqueue_us(call, 20))
            for on in settings:
                row = dict(shape=name, kind=kind, host_programs=on, grad=not args.no_grad, compiled=args.compile,
                           **{f"{k}_us": statistics.median(v) for k, v in measured[on].items()},
                           rounds=measured[on], device=torch.cuda.get_device_name(), torch=torch.__version__,
                           code=code_version())
                row["loop_over_graph"] = row["loop_us"] / row["graph_us"]
                rows.append(row)
                print(f"{name:12s} {kind:7s} {str(on):8s} {row['graph_us']:9.1f} {row['loop_us']:9.1f} "
                      f"{row['host_us']:9.1f} {row['loop_over_graph']:10.2f}", flush=True)
            if args.cprofile:
                print(python_profile(call, 200, args.cprofile))
            if args.out:
                write_json(args.out, rows)


if __name__ == "__main__":
    main()
