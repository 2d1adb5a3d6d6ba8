"""The window-attention op alone, from the qkv linear's output to the proj's input.

    python benchmarks/bench_op.py                          # every implementation, CUDA-graph replays
    python benchmarks/bench_op.py --impls eager sdpa compile ours fwa fwa2 --accuracy --published DIR
    python benchmarks/bench_op.py --loop --host-programs both   # ours in a plain loop against its replay

For each shape (B_, H, N, D, nW) and kind (V1; cosine: SwinV2's scaled cosine attention),
timm's shift mask (nW windows per image; none where nW is 0) and the relative-position
bias gathered from its ((2W-1)^2, H) table every call (the gradient reaches the table), bf16
under autocast (bias and logit scale float32 parameters):

* eager    timm's own math, as its modules run it
* sdpa     timm's SDPA path: bias + mask as a dense (B_, H, N, N) attn_mask
* compile  torch.compile of the eager math
* flex     FlexAttention (compiled), a score_mod adding bias and mask
* ours     timm_flashwin.window_attention, the bias gathered as the adapters gather it
* fwa      Flash Window Attention (``flash_swin_attn``, V1 only, no mask: it takes none)
* fwa2     Flash Window Attention V2 (``flash_win_attn_v2``, cosine only)

fwa and fwa2 are the published Triton kernels, not in this repository: ``--published DIR``
names a folder holding their packages; one that cannot run a case is an error row.
Forward (no_grad) and forward + backward: medians of CUDA-graph replays (host launches count
for none; CUDA events around plain calls where capture fails), the forward + backward's
peak memory above the inputs, ``--accuracy``: relative errors against timm's math in
float64 for the output and every gradient. The byte floor: q, k, v read and o written once
(forward; the backward adds q, k, v, dO read and dq, dk, dv written) at the copy bandwidth
measured in the run.

``--loop``: ours alone, forward + backward (``--no-grad``: the forward), three numbers a
call: ``graph us`` (CUDA-graph replay: the GPU's time), ``loop us`` (calls back to back in a
Python loop: what a step bound by the host pays), ``host us`` (one call enqueued with the
GPU idle); ``--host-programs both`` alternates host programs off and on, ``--compile``
compiles the call. GPU only.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from op_impls import (IMPLS, PUBLISHED, PUBLISHED_NO_MASK, SHAPES, eager_math, implementation, make_inputs,  # noqa: E402
                      relative_position_index, timm_mask)
from common import default_out, enqueue_us, environment, header, host_us_per_call, python_profile, write_json  # noqa
from timm_flashwin import TableBias, window_attention  # noqa: E402
from timm_flashwin.ops import host_program  # noqa: E402


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    from triton.testing import do_bench
    x = torch.empty(2 ** 30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3)


def _time_us(fn: Callable, grad_to_none=None) -> Tuple[float, str]:
    """Median time of fn: CUDA-graph replays (host launch overhead excluded, for every
    implementation alike), or CUDA events around plain calls where capture fails."""
    from triton.testing import do_bench, do_bench_cudagraph
    try:
        return 1e3 * do_bench_cudagraph(fn, rep=100, grad_to_none=grad_to_none, return_mode="median"), "graph"
    except Exception:
        torch.cuda.synchronize()
        return 1e3 * do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median"), "events"


def leaves_of(inp: Dict) -> List[torch.Tensor]:
    """The tensors of a case that take a gradient: qkv, the bias table, the logit scale."""
    return [t for t in (inp["qkv"], inp["bias"], inp["logit_scale"]) if t is not None]


def timed_passes(fn: Callable, inp: Dict) -> Tuple[Callable, Callable]:
    """(forward, forward_backward) of one implementation on one case, as they are timed:
    the forward under no_grad, both under bf16 autocast (parameters stay float32); each
    returns the output."""
    args = (inp["qkv"], inp["bias"], inp["mask"], inp["logit_scale"], inp["heads"], inp["scale"])
    device = inp["qkv"].device.type

    def forward():
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            return fn(*args)

    def forward_backward():
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn(*args)
        out.backward(inp["grad"])
        return out

    return forward, forward_backward


GRADIENT_NAMES = ("dqkv", "dtable", "dlogit_scale")  # leaves_of's order


def relative_errors(fn: Callable, inp: Dict) -> Dict[str, float]:
    """||x - ref|| / ||ref|| of fn's output and of every gradient (bf16 autocast, as timed)
    against timm's math (``eager_math``) in float64 on the same rounded inputs."""
    leaves = leaves_of(inp)
    for t in leaves:
        t.grad = None
    out = timed_passes(fn, inp)[1]()
    got = [out.detach()] + [t.grad for t in leaves]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    qkv, table = ref_leaves[:2]
    logit_scale = ref_leaves[2] if len(ref_leaves) > 2 else None
    mask = inp["mask"].double() if inp["mask"] is not None else None
    ref_out = eager_math(qkv, table, mask, logit_scale, inp["heads"], inp["scale"])
    ref_out.backward(inp["grad"].double())
    refs = [ref_out.detach()] + [t.grad for t in ref_leaves]
    for t in leaves:
        t.grad = None
    return {f"err_{name}": ((x.double() - r).norm() / r.norm()).item()
            for name, x, r in zip(("out",) + GRADIENT_NAMES, got, refs)}


def bench_one(impl: str, shape, cosine: bool, passes: List[str], masked: bool = True,
              accuracy: bool = False) -> Dict:
    inp = make_inputs(shape, cosine, masked=masked)
    leaves = leaves_of(inp)
    forward, forward_backward = timed_passes(implementation(impl), inp)
    result: Dict = {}

    try:
        if accuracy:
            result.update(relative_errors(implementation(impl), inp))
        t0 = time.perf_counter()
        forward()
        forward_backward()
        torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - t0
        if "fwd" in passes:
            result["fwd_us"], result["fwd_timing"] = _time_us(forward)
        if "fwdbwd" in passes:
            result["fwdbwd_us"], result["fwdbwd_timing"] = _time_us(forward_backward, leaves)
            for t in leaves:
                t.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward_backward()
            torch.cuda.synchronize()
            result["fwdbwd_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    except Exception as exc:  # an alternative that cannot run this case is reported, not fatal
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return result


def loop_call(shape, kind: str, grad: bool = True, compiled: bool = False) -> Callable:
    """One call of ours for ``--loop``: forward + backward (``torch.autograd.grad`` to qkv, the
    table and the logit scale), or without ``grad`` the forward under no_grad; the bias a
    ``TableBias`` (V1: timm's table; cosine: SwinV2's sigmoid table, 16.0)."""
    windows, heads, n, head_dim, periods = shape
    qkv = torch.randn(windows, n, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    table = torch.randn((2 * math.isqrt(n) - 1) ** 2, heads, device="cuda", requires_grad=True)
    index = relative_position_index(n, "cuda")
    mask = timm_mask(periods, n, "cuda") if periods else None
    grad_out = torch.randn(windows, n, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    if kind == "v1":
        bias, score, leaves = TableBias(table, index, constant_index=True), dict(scale=head_dim ** -0.5), (qkv, table)
    else:
        logit_scale = torch.full((heads, 1, 1), 2.0, device="cuda", requires_grad=True)
        bias = TableBias(table, index, 16.0, constant_index=True)
        score, leaves = dict(logit_scale=logit_scale), (qkv, table, logit_scale)
    attention = torch.compile(window_attention, fullgraph=True) if compiled else window_attention

    def call():
        if not grad:
            with torch.no_grad():
                return attention(qkv, heads, bias=bias, mask=mask, **score)
        torch.autograd.grad(attention(qkv, heads, bias=bias, mask=mask, **score), leaves, grad_out)
    return call


def graph_us(call: Callable, replays: int = 50) -> float:
    """us per CUDA-graph replay of ``call``, replays back to back."""
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


def run_loop(args) -> List[Dict]:
    """``--loop``: each case's graph, loop and host us in alternating rounds (with ``--host-programs
    both``, off and on alternating within each round), medians."""
    rows = []
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.host_programs]
    print(f"{'shape':12s} {'kind':7s} {'programs':8s} {'graph us':>9s} {'loop us':>9s} {'host us':>9s} "
          f"{'loop/graph':>10s}", flush=True)
    for name in args.shapes:
        for kind in args.kinds:
            call = loop_call(SHAPES[name], kind, grad=not args.no_grad, compiled=args.compile)
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
            host_program.ENABLED = True
            for on in settings:
                row = dict(shape=name, kind=kind, host_programs=on, grad=not args.no_grad, compiled=args.compile,
                           **{f"{k}_us": statistics.median(v) for k, v in measured[on].items()},
                           rounds=measured[on], **environment())
                row["loop_over_graph"] = row["loop_us"] / row["graph_us"]
                rows.append(row)
                print(f"{name:12s} {kind:7s} {str(on):8s} {row['graph_us']:9.1f} {row['loop_us']:9.1f} "
                      f"{row['host_us']:9.1f} {row['loop_over_graph']:10.2f}", flush=True)
            if args.cprofile:
                print(python_profile(call, 200, args.cprofile))
            write_json(args.out, rows)
    return rows


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[name for name, shape in SHAPES.items() if shape[4]],
                        choices=list(SHAPES), help="default: the Swin shapes (those with a shift mask)")
    parser.add_argument("--kinds", nargs="*", default=["v1", "cosine"], choices=["v1", "cosine"])
    parser.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS + list(PUBLISHED),
                        help="default: all but the published kernels (fwa, fwa2)")
    parser.add_argument("--passes", nargs="*", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--accuracy", action="store_true",
                        help="also each implementation's relative errors against float64 (output, every gradient)")
    parser.add_argument("--no-mask", action="store_true", help="every case without the shift mask")
    parser.add_argument("--published", default=os.path.join(os.path.dirname(__file__), "published"),
                        help="a folder holding the published kernels' packages (flash_swin_attn, flash_win_attn_v2)")
    loop = parser.add_argument_group("--loop: ours in a plain loop against its CUDA-graph replay")
    loop.add_argument("--loop", action="store_true")
    loop.add_argument("--host-programs", choices=["on", "off", "both"], default="on",
                      help="replay recorded host programs (both: off and on in alternating rounds, two rows)")
    loop.add_argument("--no-grad", action="store_true", help="the forward alone, under torch.no_grad")
    loop.add_argument("--compile", action="store_true", help="the call compiled (default mode, fullgraph)")
    loop.add_argument("--rounds", type=int, default=3, help="alternating rounds, medians reported")
    loop.add_argument("--cprofile", type=int, default=0, metavar="N",
                      help="print the N Python functions with the most own time over 200 calls of each case")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/op[_loop]_<gpu>_<commit>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.out = args.out or default_out("op_loop" if args.loop else "op")
    print(header(), flush=True)
    if args.loop:
        return run_loop(args)
    if os.path.isdir(args.published):
        sys.path.insert(0, os.path.abspath(args.published))
    bandwidth = copy_bandwidth()
    print(f"# copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    meta = dict(environment(), copy_bandwidth_Bps=bandwidth, masked=not args.no_mask)
    rows = []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        windows, heads, n, head_dim, _ = shape
        unit = windows * n * heads * head_dim * 2  # one bf16 (B_, N, H*D) tensor
        floor_fwd_us = 4 * unit / bandwidth * 1e6
        floor_fwdbwd_us = (4 + 7) * unit / bandwidth * 1e6
        for kind in args.kinds:
            for impl in args.impls:
                if PUBLISHED.get(impl, kind) != kind:
                    continue
                masked = not args.no_mask and impl not in PUBLISHED_NO_MASK and shape[4] > 0
                torch._dynamo.reset()
                res = bench_one(impl, shape, kind == "cosine", args.passes, masked, args.accuracy)
                row = dict(shape=shape_name, B_=windows, H=heads, N=n, D=head_dim, kind=kind, impl=impl,
                           masked=masked, floor_fwd_us=floor_fwd_us, floor_fwdbwd_us=floor_fwdbwd_us, **res)
                rows.append(row)
                text = "  ".join(f"{k}={v:.2e}" if k.startswith("err_") else f"{k}={v:.1f}" if isinstance(v, float)
                                 else f"{k}={v}" for k, v in res.items())
                print(f"{shape_name:11s} {kind:6s} {impl:8s} {text}", flush=True)
                write_json(args.out, dict(meta=meta, rows=rows))
    print_table(rows)
    print(f"wrote {args.out}")
    return rows


def print_table(rows: List[Dict]) -> None:
    """The accuracy rows (``--accuracy``): each implementation's errors against float64."""
    names = ("out",) + GRADIENT_NAMES
    for r in (r for r in rows if "err_out" in r):
        errs = " ".join(f"{n} {r.get('err_' + n, float('nan')):.2e}" for n in names)
        print(f"{r['shape'] + ' ' + r['kind']:20s} {r['impl']:8s} mask {'yes' if r['masked'] else 'no ':3s} {errs}")


if __name__ == "__main__":
    main()
