"""Local attention side by side: sliding windows and block sliding windows.

    python benchmarks/bench_local.py --quick                  # < 3 min on an H100
    python benchmarks/bench_local.py                          # < 8 min
    python benchmarks/bench_local.py --cases frames_w4 frames_w16 --impls ours ours_python_road flex
    python benchmarks/bench_local.py --tune frames_w16:16384  # launch plans of our kernels

For each case (a pattern, B, H, H_kv, D) and sequence length S, bf16, it times:

* ours         timm_flashwin.sliding_window_attention / block_sliding_window_attention
* flex         FlexAttention (torch.compile'd) with the same pattern as a BlockMask
               (create_block_mask of the same mask_mod, built once per case, not timed)
* sdpa_mask    F.scaled_dot_product_attention with the pattern as a dense (S, S) bool mask,
               where that mask is at most --max-mask-mib
* sdpa_causal  F.scaled_dot_product_attention(is_causal=True): PyTorch's dense causal
               (flash) kernel, a reference point of what a tuned dense kernel does with S
* ours_python_road  ours with host programs off (not in the default --impls)

The cases (``CASES``): frames of 256 tokens in windows of 16 and 4 frames (B 1, H 12, D 64,
S 4096 to 65536), a sliding window of 500 and causal (B 2, H 16, D 64), a window of 512
either side and global attention at head_dim 128, grouped-query attention. Forward and
forward + backward: medians of ``--rounds`` rounds of triton's do_bench (CUDA events), the
implementations in a rotated order; TFLOP/s on the visible (query, key) pairs only (4 D
flops a pair forward, 2.5x that backward; sdpa_causal counts the causal pairs), the forward
+ backward's peak memory above the inputs, each pass's host ms (one call enqueued with the
GPU idle: near the timed ms, the call is bound by the host), and each output's relative
error against ours. PNG plots of ms against S per case next to --out (matplotlib; ``plot.py
local`` redraws them). ``--tune CASE:S`` times launch plans of our kernels
(``kernels.local.launch.OVERRIDES``) instead and prints the fastest of each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import astuple, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from common import default_out, enqueue_us, environment, header, write_json  # noqa: E402
from plot import plot_local  # noqa: E402
from timm_flashwin import block_sliding_window_attention, sliding_window_attention  # noqa: E402
from timm_flashwin.ops import host_program  # noqa: E402
from timm_flashwin.ops.local_reference import LocalPattern  # noqa: E402


@dataclass(frozen=True)
class Case:
    pattern: LocalPattern
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    lengths: Tuple[int, ...]
    quick: Tuple[int, ...] = ()


FRAME_LENGTHS = (4096, 8192, 16384, 32768, 65536)
CASES: Dict[str, Case] = {
    "frames_w16": Case(LocalPattern.blocks(256, 16), 1, 12, 12, 64, FRAME_LENGTHS, (16384,)),
    "frames_w4": Case(LocalPattern.blocks(256, 4), 1, 12, 12, 64, FRAME_LENGTHS),
    "sliding500": Case(LocalPattern.sliding(250, 249), 2, 16, 16, 64, (2048, 4096, 8192, 16384), (8192,)),
    "causal": Case(LocalPattern.sliding(None, 0), 2, 16, 16, 64, (2048, 4096, 8192, 16384)),
    "window512_d128": Case(LocalPattern.sliding(512, 512), 1, 16, 16, 128, (8192, 16384, 32768), (16384,)),
    "global_d128": Case(LocalPattern.sliding(None, None), 1, 16, 16, 128, (8192, 16384, 32768), (16384,)),
    "gqa_causal1024_d128": Case(LocalPattern.sliding(1024, 0), 1, 32, 8, 128, (8192, 16384, 32768)),
    "gqa_frames1560_sink_d128": Case(LocalPattern.blocks(1560, 3, 64), 1, 32, 8, 128, (12480, 31200)),
}
IMPLS = ["ours", "flex", "sdpa_mask", "sdpa_causal"]
OTHER_IMPLS = ["ours_python_road"]  # more --impls: ours with host programs off


def visible_pairs(pattern: LocalPattern, seq_len: int) -> int:
    """The (query, key) pairs the pattern lets attend, from its per-row key ranges."""
    rows = torch.arange(seq_len, dtype=torch.int64)
    base = rows // pattern.period * pattern.period
    lo = (base - pattern.before).clamp(min=0) if pattern.before >= 0 else torch.zeros_like(rows)
    hi = (base + pattern.after).clamp(max=seq_len) if pattern.after >= 0 else torch.full_like(rows, seq_len)
    sink = min(pattern.sink, seq_len)
    window = (hi - lo).clamp(min=0)
    in_both = (torch.minimum(hi, torch.tensor(sink)) - lo).clamp(min=0)
    return int((window + sink - in_both).sum())


def ours(pattern: LocalPattern) -> Callable:
    if pattern.period == 1:  # a sliding window
        window = (None if pattern.before < 0 else pattern.before, None if pattern.after < 0 else pattern.after - 1)
        return lambda q, k, v: sliding_window_attention(q, k, v, window=window)
    return lambda q, k, v: block_sliding_window_attention(
        q, k, v, block_size=pattern.period, window_blocks=pattern.before // pattern.period + 1,
        sink_tokens=pattern.sink)


def ours_python_road(pattern: LocalPattern) -> Callable:
    """``ours`` with host programs off for its calls (``timm_flashwin.ops.host_program``)."""
    call = ours(pattern)

    def python_road(q, k, v):
        with host_program.switched_off():
            return call(q, k, v)
    return python_road


def mask_mod(pattern: LocalPattern) -> Callable:
    """FlexAttention's mask_mod of the pattern."""
    visible = pattern.visible()
    return lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx)


_flex_compiled = None


def flex(pattern: LocalPattern, seq_len: int, device) -> Callable:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    # compiled: the uncompiled builder evaluates the mask_mod over all S x S pairs at once
    block_mask = create_block_mask(mask_mod(pattern), None, None, seq_len, seq_len, device=device,
                                   _compile=device.type == "cuda")
    return lambda q, k, v: _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def sdpa_mask(pattern: LocalPattern, seq_len: int, device) -> Callable:
    rows = torch.arange(seq_len, device=device)
    mask = pattern.visible()(rows[:, None], rows[None, :])
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def implementation(name: str, pattern: LocalPattern, seq_len: int, device, max_mask_mib: float) -> Optional[Callable]:
    if name == "ours":
        return ours(pattern)
    if name == "ours_python_road":
        return ours_python_road(pattern)
    if name == "flex":
        return flex(pattern, seq_len, device)
    if name == "sdpa_mask":
        return sdpa_mask(pattern, seq_len, device) if seq_len * seq_len / 2 ** 20 <= max_mask_mib else None
    return sdpa_causal


def make_inputs(case: Case, seq_len: int, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    shape = lambda heads: (case.batch, heads, seq_len, case.head_dim)  # noqa: E731
    q = torch.randn(shape(case.heads), device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(shape(case.kv_heads), device=device, dtype=dtype, generator=g).requires_grad_()
            for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _time_ms(fn: Callable, grad_to_none=None, rep: int = 100) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def bench_one(fn: Callable, inputs, rep: int) -> Dict:
    """One implementation's first call, median ms of each pass (``_time_pass``), host ms of
    each pass and the forward + backward's peak memory above the inputs."""
    q, k, v, do = inputs
    leaves = [q, k, v]

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    def forward_backward():
        fn(q, k, v).backward(do)

    result: Dict = {}
    t0 = time.perf_counter()
    forward_backward()
    torch.cuda.synchronize()
    result["first_call_s"] = time.perf_counter() - t0
    result["fwd_ms"] = _time_pass(fn, inputs, True, rep)
    result["fwdbwd_ms"] = _time_pass(fn, inputs, False, rep)
    # the host's own time per call (the GPU idle when it starts): a call whose host ms is
    # near its ms above is bound by the host, not by its kernels
    result["fwd_host_ms"] = enqueue_us(forward, 20) / 1e3
    result["fwdbwd_host_ms"] = enqueue_us(forward_backward, 20) / 1e3
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward()
    torch.cuda.synchronize()
    result["fwdbwd_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    for t in leaves:
        t.grad = None
    return result


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_case(name: str, case: Case, lengths, impls: List[str], rep: int, max_mask_mib: float, rows: List[Dict],
             save: Callable, rounds: int = 1) -> None:
    """Each length: every implementation checked against ours and measured once
    (``bench_one``), then ``rounds - 1`` more rounds of both passes' times, the
    implementations in a rotated order each round; the times reported are the medians of the
    rounds (``fwd_ms_rounds``, ``fwdbwd_ms_rounds``: each round's)."""
    for seq_len in lengths:
        inputs = make_inputs(case, seq_len)
        pairs = case.batch * case.heads * visible_pairs(case.pattern, seq_len)
        causal_pairs = case.batch * case.heads * seq_len * (seq_len + 1) // 2
        with torch.no_grad():
            mine = ours(case.pattern)(*inputs[:3])
        measured: Dict[str, Tuple[Callable, Dict]] = {}
        for impl in impls:
            row = dict(case=name, impl=impl, S=seq_len, B=case.batch, H=case.heads, H_kv=case.kv_heads,
                       D=case.head_dim, visible_pairs=pairs, pattern=case.pattern.__dict__)
            try:
                fn = implementation(impl, case.pattern, seq_len, inputs[0].device, max_mask_mib)
                if fn is None:
                    continue
                if impl != "sdpa_causal":
                    with torch.no_grad():
                        row["rel_err_vs_ours"] = relative_error(fn(*inputs[:3]), mine)
                row.update(bench_one(fn, inputs, rep))
                row["fwd_ms_rounds"], row["fwdbwd_ms_rounds"] = [row["fwd_ms"]], [row["fwdbwd_ms"]]
                measured[impl] = fn, row
            except Exception as exc:  # an implementation that cannot run a case is a row, not the end
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                rows.append(row)
                print(_line(row), flush=True)
        order = list(measured)
        for r in range(1, rounds):
            for impl in order[r % len(order):] + order[:r % len(order)]:
                fn, row = measured[impl]
                row["fwd_ms_rounds"].append(_time_pass(fn, inputs, True, rep))
                row["fwdbwd_ms_rounds"].append(_time_pass(fn, inputs, False, rep))
        for impl, (fn, row) in measured.items():
            row["fwd_ms"] = statistics.median(row["fwd_ms_rounds"])
            row["fwdbwd_ms"] = statistics.median(row["fwdbwd_ms_rounds"])
            counted = causal_pairs if impl == "sdpa_causal" else pairs
            flops = 4 * counted * case.head_dim
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["fwdbwd_tflops"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
            rows.append(row)
            print(_line(row), flush=True)
        save()
        del inputs, mine, measured
        torch.cuda.empty_cache()


def _line(r: Dict) -> str:
    if "error" in r:
        return f"{r['case']:26s} S={r['S']:<6d} {r['impl']:12s} error: {r['error']}"
    err = f"  err {r['rel_err_vs_ours']:.1e}" if "rel_err_vs_ours" in r else ""
    return (f"{r['case']:26s} S={r['S']:<6d} {r['impl']:12s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s"
            f"  f+b {r['fwdbwd_ms']:8.3f} ms {r['fwdbwd_tflops']:6.1f} TF/s  peak {r['fwdbwd_peak_mib']:8.1f} MiB"
            f"  host {r['fwd_host_ms']:.3f} / {r['fwdbwd_host_ms']:.3f} ms{err}")


def summary(rows: List[Dict]) -> List[str]:
    """The issue's targets, measured: our speedup over FlexAttention per case and S, the
    window's TFLOP/s against global attention's, the forward's TFLOP/s at head_dim 128."""
    lines, by = [], {(r["case"], r["S"], r["impl"]): r for r in rows if "error" not in r}
    for (case, seq_len, impl), r in by.items():
        f = by.get((case, seq_len, "flex"))
        if impl == "ours" and f:
            lines.append(f"{case:26s} S={seq_len:<6d} ours vs flex: fwd {f['fwd_ms'] / r['fwd_ms']:.2f}x, "
                         f"f+b {f['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x")
    for (case, seq_len, impl), r in by.items():
        g = by.get(("global_d128", seq_len, "ours"))
        if case == "window512_d128" and impl == "ours" and g:
            lines.append(f"window 512 / global TFLOP/s at S={seq_len}: fwd {r['fwd_tflops'] / g['fwd_tflops']:.2f}, "
                         f"f+b {r['fwdbwd_tflops'] / g['fwdbwd_tflops']:.2f}")
    return lines


def _time_pass(fn: Callable, inputs, forward_only: bool, rep: int) -> float:
    """Median ms of the forward (no grad) or of forward+backward."""
    q, k, v, do = inputs
    if forward_only:
        with torch.no_grad():
            return _time_ms(lambda: fn(q, k, v), rep=rep)
    return _time_ms(lambda: fn(q, k, v).backward(do), [q, k, v], rep=rep)


def tune(spec: str, rep: int, kinds=("fwd", "dq", "dkdv")) -> List[Dict]:
    """Time launch plans of our kernels ``kinds`` on one case (forward plans by the forward,
    backward ones by forward+backward), the others at their defaults. The case's length
    decides which plans it tunes: those of its class of rows (``local_plan.row_class``)."""
    from timm_flashwin.kernels.local import plan as local_plan
    from timm_flashwin.kernels.arch import device_arch
    name, seq_len = spec.split(":")
    case, seq_len = CASES[name], int(seq_len)
    arch = device_arch(torch.device("cuda"))
    rows_class = local_plan.row_class(astuple(case.pattern), seq_len, seq_len, case.batch * case.heads, arch)
    inputs = make_inputs(case, seq_len)
    fn = ours(case.pattern)
    # (4, 2): the fastest of a minimal global forward's plans at head_dim 128 on an H100
    # (128 x 64 tiles; docs/design.md, "What the removed probes found")
    warps_stages = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))
    tile_pairs = {"fwd": ((64, 32), (64, 64), (64, 128), (128, 64), (128, 128)),
             "dq": ((32, 64), (64, 32), (64, 64), (128, 32), (128, 64)),
             "dkdv": ((16, 64), (32, 32), (32, 64), (64, 64), (16, 128), (32, 128), (64, 128))}
    candidates = {kind: [(m, n, w, s) for m, n in pairs for w, s in warps_stages]
                  for kind, pairs in tile_pairs.items()}
    rows = []
    for kind in kinds:
        plans = candidates[kind]
        key = (kind, case.head_dim, torch.bfloat16, rows_class)
        default = local_plan.plan(kind, case.head_dim, torch.bfloat16, rows_class, arch=arch)
        for tiles in [default] + [local_plan.Plan(*p) for p in plans]:
            local_plan.OVERRIDES[key] = tiles
            try:
                ms, result = _time_pass(fn, inputs, forward_only=kind == "fwd", rep=rep), {}
            except Exception as exc:  # a plan that does not fit (shared memory) is reported
                ms, result = float("nan"), dict(error=f"{type(exc).__name__}")
            rows.append(dict(case=name, S=seq_len, kind=kind, rows=rows_class, plan=tiles.__dict__, ms=ms, default=tiles == default,
                             **{k: v for k, v in result.items() if k == "error"}))
            print(f"{kind:5s} {tiles} {ms:8.3f} ms{' (default)' if tiles == default else ''}", flush=True)
        local_plan.OVERRIDES.pop(key)
        timed = [r for r in rows if r["kind"] == kind and r["ms"] == r["ms"]]
        best = min(timed, key=lambda r: r["ms"])
        print(f"fastest {kind}: {best['plan']} {best['ms']:.3f} ms", flush=True)
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS + OTHER_IMPLS)
    parser.add_argument("--quick", action="store_true", help="a few lengths per case (< 3 minutes on an H100)")
    parser.add_argument("--max-mask-mib", type=float, default=256.0,
                        help="the largest dense bool mask sdpa_mask builds (S * S bytes)")
    parser.add_argument("--tune", metavar="CASE:S", nargs="+", default=None,
                        help="time launch plans of our kernels on these cases instead")
    parser.add_argument("--tune-kinds", nargs="+", default=["fwd", "dq", "dkdv"], choices=["fwd", "dq", "dkdv"],
                        help="the kernels --tune times")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of each length's timings, the implementations alternated; medians reported")
    parser.add_argument("--out", default=None, help="the JSON, the plots next to it; default: "
                        "benchmarks/results/local[_tune]_<gpu>_<commit>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rep = 30 if args.quick else 100
    # FlexAttention compiles once per length and pattern: more than dynamo's default of 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    meta = dict(environment(), quick=args.quick, rounds=args.rounds)
    print(header(), flush=True)
    out = args.out or default_out("local_tune" if args.tune else "local")
    if args.tune:
        rows = [row for spec in args.tune for row in tune(spec, rep, args.tune_kinds)]
        write_json(out, dict(meta=meta, tune=rows))
        return
    rows: List[Dict] = []
    save = lambda: write_json(out, dict(meta=meta, rows=rows, summary=summary(rows)))  # noqa: E731
    for name in args.cases:
        case = CASES[name]
        lengths = case.quick if args.quick else case.lengths
        run_case(name, case, lengths, args.impls, rep, args.max_mask_mib, rows, save, args.rounds)
    print("\n" + "\n".join(summary(rows)))
    plot_local(rows, out)


if __name__ == "__main__":
    main()
