"""SAM / ViTDet attention with its decomposed relative-position bias, one block at a time:
timm's road against FlexAttention, SDPA without the bias and ours, forward and forward +
backward, side by side in alternating rounds (GPU time by CUDA events, medians).

    python benchmarks/bench_rel_pos.py                     # SAM ViT-B/H at 1024 px, 640 and 2048 px
    python benchmarks/bench_rel_pos.py --cases global64 window14 --rounds 5
    python benchmarks/bench_rel_pos.py --module            # the attention modules (qkv, proj) too
    python benchmarks/bench_rel_pos.py --tune global64     # the biased kernels' plans compared

Implementations (each includes what it needs of the bias: the two terms from q and the
tables, ``rel_pos_table_terms`` as the patched modules compute them (timm's road gathers the
tables and takes its einsums), and their backward):

* ``timm``: timm's ``get_decomposed_rel_pos_bias`` (a dense (B*heads, N, N) bias) and SDPA on
  (B*heads, N, D) tensors, as ``vision_transformer_sam.Attention`` runs it;
* ``flex``: FlexAttention (compiled) with a ``score_mod`` that gathers rel_h and rel_w;
* ``sdpa-no-bias``: SDPA without the bias (the flash road): what the attention costs alone;
* ``flashwin-no-bias``: our kernels without the bias (``sliding_window_attention``, global);
* ``flashwin``: ``decomposed_attention``.

``--module``: timm's ``Attention`` module against the patched one (its qkv and proj, the
tables' gather), x (B, H, W, C). Columns: milliseconds, TFLOP/s of the attention's
matrix products (4 B H N^2 D forward, 2.5x that backward), peak MiB above the inputs.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from common import default_out, header, write_json, environment  # noqa: E402
from common import profile  # noqa: E402
from timm_flashwin import decomposed_attention, patch_model, rel_pos_table_terms, sliding_window_attention  # noqa: E402

#: name: (batch of windows or images, heads, grid side, head_dim); SAM at 1024 px, batch 4:
#: global blocks over 64 x 64 tokens, window blocks over 25 windows an image of 14 x 14
CASES = {
    "global64": (4, 12, 64, 64), "window14": (100, 12, 14, 64),
    "global64-vith": (4, 16, 64, 80), "window14-vith": (100, 16, 14, 80),
    "global40": (4, 12, 40, 64), "global128": (1, 12, 128, 64),
}
IMPLEMENTATIONS = ("timm", "flex", "sdpa-no-bias", "flashwin-no-bias", "flashwin")


def inputs(shape, dtype=torch.bfloat16, device="cuda"):
    """qkv (B, N, 3, heads, D) and the two tables (2 side - 1, D) of a case's shape."""
    batch, heads, side, head_dim = shape
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, side * side, 3, heads, head_dim, generator=g).to(device, dtype)
    tables = [(torch.randn(2 * side - 1, head_dim, generator=g) * head_dim ** -0.5).to(device) for _ in range(2)]
    return [qkv.requires_grad_()] + [t.requires_grad_() for t in tables]


def views(qkv):
    return [t.transpose(1, 2) for t in qkv.unbind(2)]  # (B, heads, N, D) each, as the patched module takes them


def attention(impl: str, side: int, flex_fn=None):
    """The function of (qkv, table_h, table_w) -> out that ``impl`` computes."""
    from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias

    def timm_road(qkv, table_h, table_w):
        B, n, _, heads, D = qkv.shape
        q, k, v = qkv.permute(2, 0, 3, 1, 4).reshape(3, B * heads, n, D).unbind(0)
        bias = get_decomposed_rel_pos_bias(q, table_h.to(q.dtype), table_w.to(q.dtype), (side, side), (side, side))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def terms(q, table_h, table_w):
        return rel_pos_table_terms(q, table_h.to(q.dtype), table_w.to(q.dtype), (side, side))

    def flashwin(qkv, table_h, table_w):
        q, k, v = views(qkv)
        rel_h, rel_w = terms(q, table_h, table_w)
        return decomposed_attention(q, k, v, rel_h, rel_w, key_size=(side, side))

    def flex(qkv, table_h, table_w):
        q, k, v = views(qkv)
        rel_h, rel_w = terms(q, table_h, table_w)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + rel_h[b, h, q_idx, kv_idx // side] + rel_w[b, h, q_idx, kv_idx % side]
        return flex_fn(q, k, v, score_mod=score_mod)

    def sdpa(qkv, table_h, table_w):
        q, k, v = views(qkv)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def unbiased(qkv, table_h, table_w):
        return sliding_window_attention(*views(qkv))
    return {"timm": timm_road, "flex": flex, "flashwin": flashwin, "sdpa-no-bias": sdpa,
            "flashwin-no-bias": unbiased}[impl]


def timed(fn, tensors, backward: bool):
    """(the step, a fresh output gradient) for forward or forward + backward."""
    out = fn(*tensors)
    grad = torch.randn_like(out)

    def step():
        y = fn(*tensors)
        if backward:
            torch.autograd.backward(y, grad)
    return step


def gpu_ms(step, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def peak_mib(step) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def run_case(case: str, impls, rounds: int, repeats: int, module: bool, top: int = 0) -> list:
    batch, heads, side, head_dim = CASES[case]
    flops = 4 * batch * heads * (side * side) ** 2 * head_dim
    flex_fn = None
    if "flex" in impls:
        from torch.nn.attention.flex_attention import flex_attention
        flex_fn = torch.compile(flex_attention, dynamic=False)
    tensors = inputs(CASES[case])
    steps = {}
    for impl in impls:
        fn = attention(impl, side, flex_fn)
        for backward in (False, True):
            try:
                step = timed(fn, tensors, backward)
                for _ in range(3):
                    step()
                steps[(impl, backward)] = step
            except Exception as error:  # an implementation that cannot run a shape (memory) is reported, not fatal
                print(f"{case} {impl} {'f+b' if backward else 'fwd'}: {type(error).__name__}: {str(error)[:120]}")
                torch.cuda.empty_cache()
    if module:
        steps.update(module_steps(case))
    times = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(gpu_ms(step, repeats))
    rows = []
    for (impl, backward), step in steps.items():
        ms = statistics.median(times[(impl, backward)])
        work = flops * (3.5 if backward else 1.0)
        row = dict(case=case, shape=CASES[case], impl=impl, pass_="f+b" if backward else "fwd", ms=ms,
                   ms_rounds=times[(impl, backward)], tflops=work / ms / 1e9, peak_mib=peak_mib(step),
                   **environment())
        if top and backward:  # where the GPU's time goes, kernel by kernel
            row["launches"], row["gpu_ms"], _, row["gpu_kernels"] = profile(step, 2, top)
        rows.append(row)
    return rows


def module_steps(case: str) -> dict:
    """timm's Attention module and the patched one on x (B, side, side, C), f+b."""
    from timm.models.vision_transformer_sam import Attention
    batch, heads, side, head_dim = CASES[case]
    dim = heads * head_dim
    timm_module = Attention(dim, heads, use_rel_pos=True, input_size=(side, side)).cuda()
    with torch.no_grad():
        for table in (timm_module.rel_pos_h, timm_module.rel_pos_w):
            table.normal_(0, head_dim ** -0.5)
    ours = patch_model(copy.deepcopy(timm_module))
    x = torch.randn(batch, side, side, dim, device="cuda", requires_grad=True)
    steps = {}
    for name, module in (("module-timm", timm_module), ("module-flashwin", ours)):
        def step(module=module):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(x)
            y.float().square().mean().backward()
        for _ in range(3):
            step()
        steps[(name, True)] = step
    return steps


def tune(case: str, rounds: int, repeats: int) -> list:
    """The biased kernels' f+b under other plans (``kernels.local.plan.OVERRIDES`` for every
    class of rows, before the bias's own adjustments): the default first."""
    from timm_flashwin.kernels.local import plan as local_plan
    batch, heads, side, head_dim = CASES[case]
    tensors = inputs(CASES[case])
    fn = attention("flashwin", side)
    variants = {"default": {}}
    for warps in (4, 8):
        for kind, block_m, block_n in (("dkdv", 64, 64), ("dkdv", 32, 64), ("dkdv", 64, 32), ("dq", 64, 64),
                                       ("dq", 32, 64), ("dq", 128, 64), ("fwd", 64, 64), ("fwd", 128, 64)):
            if block_n != side and side in (64, 128) and kind != "dkdv":
                continue
            variants[f"{kind} {block_m}x{block_n} w{warps}"] = {kind: local_plan.Plan(block_m, block_n, warps, 3)}
    steps = {}
    for name, plans in variants.items():
        local_plan.OVERRIDES.clear()
        for kind, plan in plans.items():
            for rows in (local_plan.SHORT, local_plan.LONG, local_plan.TALL):
                local_plan.OVERRIDES[(kind, head_dim, torch.bfloat16, rows)] = plan
        try:
            step = timed(fn, tensors, True)
            for _ in range(2):
                step()
            times = [gpu_ms(step, repeats) for _ in range(rounds)]
            steps[name] = statistics.median(times)
        except Exception as error:
            print(f"{case} {name}: {type(error).__name__}: {str(error)[:100]}")
    local_plan.OVERRIDES.clear()
    rows = [dict(case=case, variant=name, ms=ms, **environment()) for name, ms in steps.items()]
    for row in sorted(rows, key=lambda r: r["ms"]):
        print(f"{case:14s} {row['variant']:24s} {row['ms']:8.3f} ms")
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--impls", nargs="*", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--module", action="store_true", help="the attention modules too")
    parser.add_argument("--top", type=int, default=0, help="print each f+b's N largest GPU kernels (profiled)")
    parser.add_argument("--tune", nargs="*", default=None, choices=list(CASES), help="compare plans of the biased kernels")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/rel_pos_<gpu>_<commit>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(header(), flush=True)
    rows = []
    if args.tune is not None:
        out = args.out or default_out("rel_pos_tune")
        for case in args.tune or ["global64", "window14"]:
            rows += tune(case, args.rounds, args.repeats)
            write_json(out, rows)
        print(f"wrote {out}")
        return rows
    out = args.out or default_out("rel_pos")
    print(f"{'case':14s} {'impl':16s} {'pass':4s} {'ms':>8s} {'TFLOP/s':>8s} {'peak MiB':>9s}  vs sdpa-no-bias")
    for case in args.cases:
        group = run_case(case, args.impls, args.rounds, args.repeats, args.module, args.top)
        base = {r["pass_"]: r["ms"] for r in group if r["impl"] == "sdpa-no-bias"}
        for r in group:
            ratio = f"{r['ms'] / base[r['pass_']]:.2f}x" if r["pass_"] in base else ""
            print(f"{case:14s} {r['impl']:16s} {r['pass_']:4s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['peak_mib']:9.0f}  "
                  f"{ratio}", flush=True)
            for kernel in r.get("gpu_kernels", [])[:args.top]:
                print(f"      gpu {kernel['us_per_step']:9.0f} us {kernel['calls_per_step']:5.0f}x  {kernel['name'][:80]}")
        rows += group
        write_json(out, rows)
        torch.cuda.empty_cache()
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
