"""Training steps as a user runs them: timm against patched, eager and torch.compile, with
the host's and the GPU's time per step side by side.

    python benchmarks/bench_train.py --models swin_tiny_patch4_window7_224 --modes eager compile \
        --batches 64 128 --out results/train.json

For each model, batch and mode (``eager``; ``compile``: torch.compile's default mode;
``reduce-overhead``: with CUDA graphs) the variants are built from one perturbed model,
warmed up (compiled), then timed in alternating rounds of back-to-back AMP bf16 steps
(forward, cross-entropy, backward, AdamW), a plain Python loop, no CUDA graphs but the
mode's own. Columns, per variant (median over the rounds):

* ``img/s`` and ``wall ms``: steps run back to back, synchronized at the end of a round.
* ``host ms``: the host's time to enqueue one step with the GPU idle when it starts (the
  step call alone): the host's work per step. A step whose host ms is at or above its
  GPU ms is bound by the host.
* ``GPU ms`` and ``launches``: the kernels' time and count per step under torch.profiler.
* ``speedup_rounds``: patched / timm speed within each round (their median, beside the
  ratio of the medians: a host that drifts between rounds moves every variant of a round).
* ``peak MiB``: the variant's peak memory as if it ran alone: the allocator's peak during
  its steps, less what was allocated before them, plus its own parameters and AdamW's
  moments (every variant stays resident for the alternating rounds).

``--recompute-qkv [PREFIX ...]`` adds a third variant, patched with
``patch_model(..., recompute_qkv=...)`` for every module (no prefix) or for the modules
whose qualified names start with a prefix (``layers.1.``: the second stage).
``--python-road`` adds a variant patched alike whose op calls keep their Python road
(``timm_flashwin.ops.host_program.switched_off`` around its steps): what the host programs save.

GPU only.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, peak_mib, write_json  # noqa: E402
from profile_step import _profile, alternating_rounds, warm_up  # noqa: E402
from timm_flashwin.ops import host_program
from timm_flashwin import patch_model  # noqa: E402
from timm_flashwin.tools.bench import _step_fn, model_variants, recompute_qkv_option  # noqa: E402
from timm_flashwin.tools.verify import build_model  # noqa: E402

MODELS = ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224"]
MODES = {"eager": None, "compile": "default", "reduce-overhead": "reduce-overhead"}


def _without_host_programs(step):
    """``step`` with the op's calls on their Python road (``host_program.switched_off``)."""
    def run() -> None:
        with host_program.switched_off():
            step()
    return run


def run_group(name: str, batch: int, mode: str, rounds: int, repeats: int, warmup: int,
              recompute_qkv=False, python_road: bool = False) -> list:
    """The variants of one (model, batch, mode) (``model_variants(recompute_qkv)``), timed
    in alternating rounds."""
    base = build_model(name)
    size = base.pretrained_cfg["input_size"][1:]
    images = torch.randn(batch, 3, *size, device="cuda")
    variants = {}
    labels = model_variants(recompute_qkv)
    if python_road:
        labels["flashwin-python"] = False
    for variant, recompute in labels.items():
        model = copy.deepcopy(base).cuda().train()
        if variant != "timm":
            patch_model(model, recompute_qkv=recompute)
        runnable = model if MODES[mode] is None else torch.compile(model, mode=MODES[mode])
        step = _step_fn(runnable, images, torch.bfloat16, train=True)
        if variant == "flashwin-python":
            step = _without_host_programs(step)
        warm_up(step, warmup, f"{name} b{batch} {mode} {variant}")
        variants[variant] = (model, step)
    timings = alternating_rounds({variant: step for variant, (_, step) in variants.items()}, rounds, repeats)
    rows = []
    for variant, (model, step) in variants.items():
        wall, host = (statistics.median(t) for t in timings[variant])
        launches, gpu_ms, host_ops, gpu_kernels = _profile(step, 2, 25)
        rows.append(dict(model=name, batch=batch, mode=mode, variant=variant, images_per_s=batch / wall * 1e3,
                         wall_ms=wall, host_ms=host, gpu_ms=gpu_ms, launches=launches,
                         peak_mib=peak_mib(model, step, train=True), wall_ms_rounds=timings[variant][0],
                         host_ms_rounds=timings[variant][1], host_ops=host_ops, gpu_kernels=gpu_kernels,
                         device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version()))
    for row in rows[1:]:  # per round (``alternating_rounds``)
        ratios = [t / p for t, p in zip(timings["timm"][0], timings[row["variant"]][0])]
        row.update(speedup_rounds=ratios, speedup_round_median=statistics.median(ratios))
    del variants
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--modes", nargs="*", default=["eager", "compile"], choices=list(MODES))
    parser.add_argument("--batches", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--repeats", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (the first compiles)")
    parser.add_argument("--recompute-qkv", nargs="*", default=None, metavar="PREFIX",
                        help="a third variant with patch_model's recompute_qkv: every module, or those "
                             "whose names start with a PREFIX")
    parser.add_argument("--python-road", action="store_true",
                        help="a variant patched alike whose op calls keep their Python road (no host programs)")
    parser.add_argument("--top", type=int, default=0, help="print the N largest host ops and GPU kernels per row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'model':30s} {'b':>4s} {'mode':15s} {'variant':15s} {'img/s':>8s} {'wall ms':>8s} {'host ms':>8s} "
          f"{'GPU ms':>7s} {'launches':>8s} {'peak MiB':>8s}", flush=True)
    for name in args.models:
        for batch in args.batches:
            for mode in args.modes:
                group = run_group(name, batch, mode, args.rounds, args.repeats, args.warmup,
                                  recompute_qkv_option(args.recompute_qkv), args.python_road)
                rows += group
                for r in group:
                    print(f"{name[:30]:30s} {batch:4d} {mode:15s} {r['variant'][:15]:15s} {r['images_per_s']:8.1f} "
                          f"{r['wall_ms']:8.2f} {r['host_ms']:8.2f} {r['gpu_ms']:7.2f} {r['launches']:8.0f} "
                          f"{r['peak_mib']:8.0f}", flush=True)
                    for op in r["host_ops"][:args.top]:
                        print(f"      host {op['self_cpu_us_per_step']:9.0f} us {op['calls_per_step']:6.0f}x  "
                              f"{op['name'][:90]}")
                timm = group[0]
                for ours in group[1:]:
                    low, high = min(ours["speedup_rounds"]), max(ours["speedup_rounds"])
                    print(f"{'':30s} {batch:4d} {mode:15s} {ours['variant']}/timm: "
                          f"{ours['images_per_s'] / timm['images_per_s']:.2f}x speed (rounds {low:.2f}x to "
                          f"{high:.2f}x, median {ours['speedup_round_median']:.2f}x), "
                          f"{ours['peak_mib'] / timm['peak_mib']:.2f}x peak, host {ours['host_ms']:.1f} vs "
                          f"{timm['host_ms']:.1f} ms", flush=True)
                if args.out:
                    write_json(args.out, rows)


if __name__ == "__main__":
    main()
