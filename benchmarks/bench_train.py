"""Whole timm models (and torchvision's, ``tv:NAME``), unpatched against patched: training steps
(or inference, ``--task infer``), eager, torch.compile and CUDA graphs, with the host's and
the GPU's time per step.

    python benchmarks/bench_train.py --models swin_tiny_patch4_window7_224 --modes eager compile --batches 64 128
    python benchmarks/bench_train.py --models tv:swin_t tv:swin_v2_t tv:swin3d_t beit_base_patch16_224
    python benchmarks/bench_train.py --task infer --modes eager compile          # every model, batch 128
    python benchmarks/bench_train.py --models gcvit_tiny --modes compile --batches 64 \\
        --variants timm flashwin attention-free --top 8                          # against the bound
    python benchmarks/bench_train.py --models swin_tiny_patch4_window7_224 --modes reduce-overhead --sequential

For each model, batch and mode (``eager``; ``compile``: torch.compile's default mode;
``reduce-overhead``: with CUDA graphs) the variants are built from one perturbed model,
warmed up (compiled), then timed in alternating rounds of back-to-back steps in a plain
Python loop. Training: AMP bf16 steps (forward, cross-entropy, backward, AdamW); inference:
bf16 weights under torch.inference_mode. Columns per variant (medians over the rounds):

* ``img/s``, ``wall ms``: steps back to back, synchronized at the end of a round.
* ``host ms``: the time to enqueue one step with the GPU idle: the host's work per step
  (a step whose host ms is at or above its GPU ms is bound by the host).
* ``GPU ms``, ``launches``: kernel time and count per step under torch.profiler.
* ``speedup_rounds``: timm / variant wall time within each round.
* ``peak MiB``: the variant's peak as if it ran alone (``common.peak_mib``).

Variants: ``timm``; ``flashwin`` (``patch_model``); ``flashwin-python`` (patched, its op calls
on the Python road: host programs off, ``--python-road``; a line per group then gives the
host programs' gain, and the ``flashwin`` row ``host_programs_rounds``: the Python road's wall
over theirs in each round); ``flashwin-recompute-qkv``
(``--recompute-qkv [PREFIX ...]``: ``recompute_qkv`` for every module or those whose names
start with a prefix); ``attention-free`` (every attention module that ``patch_model`` serves
reduced to proj(qkv(x)[..., :C]): the bound of any attention implementation).

``--sequential``: one variant after the other through ``timm_flashwin.tools.bench.benchmark_model``
(the code of ``timm-flashwin bench``: images/s over blocks of steps, the peak from
``max_memory_allocated``, the first iteration's time), no profile. GPU only.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from common import (alternating_rounds, default_out, environment, header, peak_mib, profile,  # noqa: E402
                    warm_up, write_json)
from timm_flashwin import patch_model  # noqa: E402
from timm_flashwin.ops import host_program
from timm_flashwin.patching.adapters import adapter_for
from timm_flashwin.tools.bench import _step_fn, benchmark_model, model_variants, recompute_qkv_option
from timm_flashwin.tools.verify import build_model

MODELS = {  # name: (inference batch, training batch)
    "swin_tiny_patch4_window7_224": (128, 64),
    "swinv2_tiny_window8_256": (128, 64),
    "swinv2_cr_tiny_224": (128, 64),
    "swinv2_base_window12to24_192to384": (32, 16),
    "maxvit_tiny_tf_224": (128, 64),
    "coatnet_0_rw_224": (128, 64),
    "gcvit_tiny": (128, 64),
    "tiny_vit_21m_224": (128, 64),
    "davit_tiny": (128, 64),
    "twins_svt_small": (128, 64),
    "nest_tiny": (128, 64),
    "hiera_tiny_224": (128, 64),
    "beit_base_patch16_224": (128, 64),
    # torchvision's (timm_flashwin.tools.tv_models): swin3d_t on clips of 16 x 224 x 224
    "tv:swin_t": (128, 64),
    "tv:swin_v2_t": (128, 64),
    "tv:swin3d_t": (8, 4),
    "samvit_base_patch16": (4, 4),  # 1024 px: 64 x 64 tokens, global and 14 x 14 window blocks
    "hf:SamVisionConfig": (4, 4),  # transformers' SAM ViT-B image encoder, 1024 px
}
SWIN = list(MODELS)[:3]
MODES = {"eager": None, "compile": "default", "reduce-overhead": "reduce-overhead"}
VARIANTS = ["timm", "flashwin", "flashwin-python", "attention-free"]


class _KeepsGradient(torch.autograd.Function):
    """``out`` as it is; ``made`` gets a zero gradient, so that the layers that made it run
    their backward as they do when attention reads it."""

    @staticmethod
    def forward(ctx, out, made):
        ctx.made = made.shape, made.dtype, made.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.made
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _attention_free_forward(module, x, *args, **kwargs):
    """proj(the first C channels of qkv(x)): channels last, or channels first for 1x1
    convolution projections (Attention2d); x normalized first where the module normalizes
    its own input (TinyViT). A mask is not read; a tensor that takes a gradient (GCViT's
    q_global) is not read but gets a zero one, so that the layers that make it still run
    their backward. A module that pools its queries (Hiera's ``q_stride``) returns one
    token a query."""
    norm = getattr(module, "norm", None)
    if isinstance(norm, torch.nn.Module):
        x = norm(x)
    qkv = module.qkv(x)
    channels_first = isinstance(module.qkv, torch.nn.Conv2d)
    y = qkv[:, :module.proj.in_channels] if channels_first else qkv[..., :module.proj.in_features]
    y = y[:, :y.shape[1] // getattr(module, "q_stride", 1)]
    out = getattr(module, "proj_drop", torch.nn.Identity())(module.proj(y))
    for made in (*args, *kwargs.values()):
        if isinstance(made, torch.Tensor) and made.requires_grad and torch.is_grad_enabled():
            out = _KeepsGradient.apply(out, made)
    return out


def attention_free(model: torch.nn.Module) -> torch.nn.Module:
    """The ``attention-free`` variant, in place: every module ``patch_model`` serves gets
    ``_attention_free_forward``; those it leaves to timm keep timm's, as when patched."""
    for module in model.modules():
        adapter = adapter_for(module)
        if adapter is not None and adapter.unsupported(module) is None:
            module.forward = types.MethodType(_attention_free_forward, module)
    return model


def _python_road(step):
    def run() -> None:
        with host_program.switched_off():
            step()
    return run


def run_group(name: str, batch: int, mode: str, args) -> list:
    """The variants of one (model, batch, mode), timed in alternating rounds."""
    train = args.task == "train"
    base = build_model(name)
    images = torch.randn(batch, 3, *base.pretrained_cfg["input_size"][1:], device="cuda")
    labels = {v: False for v in args.variants}
    labels.update({k: v for k, v in model_variants(recompute_qkv_option(args.recompute_qkv)).items()
                   if k not in ("timm", "flashwin")})
    if args.python_road:
        labels["flashwin-python"] = False
    variants = {}
    for variant, recompute in labels.items():
        model = copy.deepcopy(base).cuda().train(train)
        if variant == "attention-free":
            attention_free(model)
        elif variant != "timm":
            patch_model(model, recompute_qkv=recompute)
        x = images
        if not train:
            model, x = model.to(torch.bfloat16), images.to(torch.bfloat16)
        runnable = model if MODES[mode] is None else torch.compile(model, mode=MODES[mode])
        step = _step_fn(runnable, x, torch.bfloat16, train)
        if variant == "flashwin-python":
            step = _python_road(step)
        warm_up(step, args.warmup, f"{name} b{batch} {mode} {variant}")
        variants[variant] = (model, step)
    timings = alternating_rounds({v: step for v, (_, step) in variants.items()}, args.rounds, args.repeats)
    rows = []
    for variant, (model, step) in variants.items():
        wall, host = (statistics.median(t) for t in timings[variant])
        launches, gpu_ms, host_ops, gpu_kernels = profile(step, 2, max(args.top, 25))
        rows.append(dict(model=name, task=args.task, batch=batch, mode=mode, variant=variant,
                         images_per_s=batch / wall * 1e3, wall_ms=wall, host_ms=host, gpu_ms=gpu_ms,
                         launches=launches, peak_mib=peak_mib(model, step, train), wall_ms_rounds=timings[variant][0],
                         host_ms_rounds=timings[variant][1], host_ops=host_ops, gpu_kernels=gpu_kernels,
                         **environment()))
    if "timm" in timings:
        for row in rows:
            ratios = [t / p for t, p in zip(timings["timm"][0], timings[row["variant"]][0])]
            row.update(speedup_rounds=ratios, speedup_round_median=statistics.median(ratios))
    if "flashwin" in timings and "flashwin-python" in timings:
        # what the host programs give: the Python road's wall / theirs, round by round
        ratios = [p / h for p, h in zip(timings["flashwin-python"][0], timings["flashwin"][0])]
        rows[list(variants).index("flashwin")].update(host_programs_rounds=ratios,
                                                      host_programs_round_median=statistics.median(ratios))
    del variants
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def run_sequential(name: str, batch: int, mode: str, args) -> list:
    """``benchmark_model``'s rows for one (model, batch, mode): timm, then patched."""
    result = benchmark_model(name, batch=batch, dtype="bfloat16", train=args.task == "train",
                             compile=MODES[mode] is not None, compile_mode=None if mode == "compile" else MODES[mode],
                             warmup=args.warmup, repeats=args.repeats,
                             recompute_qkv=recompute_qkv_option(args.recompute_qkv))
    runs = "  ".join(f"{r.variant}: {r.images_per_s:8.1f} img/s {r.peak_mib:7.0f} MiB (first {r.first_iter_s:.1f} s)"
                     for r in result.runs)
    print(f"{name:36s} {args.task:5s} b{batch:<4d} {runs}  speedup {result.speedup():.2f}x", flush=True)
    return [dict(result.to_dict(), task=args.task, mode=mode, **environment())]


def report(group: list, top: int) -> None:
    for r in group:
        print(f"{r['model'][:30]:30s} {r['batch']:4d} {r['mode']:15s} {r['variant'][:22]:22s} "
              f"{r['images_per_s']:8.1f} {r['wall_ms']:8.2f} {r['host_ms']:8.2f} {r['gpu_ms']:7.2f} "
              f"{r['launches']:8.0f} {r['peak_mib']:8.0f}", flush=True)
        for op in r["host_ops"][:top]:
            print(f"      host {op['self_cpu_us_per_step']:9.0f} us {op['calls_per_step']:6.0f}x  {op['name'][:90]}")
        for k in r["gpu_kernels"][:top]:
            print(f"      gpu  {k['us_per_step']:9.0f} us {k['calls_per_step']:6.0f}x  {k['name'][:90]}")
    timm = next((r for r in group if r["variant"] == "timm"), None)
    for ours in group:
        if timm is not None and ours is not timm:
            print(f"{'':30s} {ours['variant']}/timm: {ours['images_per_s'] / timm['images_per_s']:.2f}x speed (rounds "
                  f"{min(ours['speedup_rounds']):.2f}x to {max(ours['speedup_rounds']):.2f}x, median "
                  f"{ours['speedup_round_median']:.2f}x), {ours['peak_mib'] / timm['peak_mib']:.2f}x peak, host "
                  f"{ours['host_ms']:.1f} vs {timm['host_ms']:.1f} ms, GPU {ours['gpu_ms']:.1f} vs "
                  f"{timm['gpu_ms']:.1f} ms", flush=True)


def report_host_programs(group: list) -> None:
    """One line: the patched model with host programs against the same model on the Python
    road (``--python-road``), timed in the same rounds."""
    rows = {r["variant"]: r for r in group}
    ours, python = rows.get("flashwin"), rows.get("flashwin-python")
    if ours is None or python is None:
        return
    ratios = ours["host_programs_rounds"]
    print(f"{'':30s} host programs vs Python road: wall {python['wall_ms']:.2f} -> {ours['wall_ms']:.2f} ms "
          f"({python['wall_ms'] / ours['wall_ms']:.2f}x; rounds {min(ratios):.2f}x to {max(ratios):.2f}x, median "
          f"{ours['host_programs_round_median']:.2f}x), host {python['host_ms']:.1f} -> {ours['host_ms']:.1f} ms, "
          f"GPU {python['gpu_ms']:.1f} -> {ours['gpu_ms']:.1f} ms", flush=True)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=SWIN, help=f"default: the Swin tiny models; any of {list(MODELS)} "
                        "(or another timm or tv: name with --batches)")
    parser.add_argument("--task", default="train", choices=["train", "infer"])
    parser.add_argument("--modes", nargs="*", default=["eager", "compile"], choices=list(MODES))
    parser.add_argument("--batches", nargs="*", type=int, default=None,
                        help="default: the model's batch for the task (128 / 64; the window-24 base 32 / 16)")
    parser.add_argument("--variants", nargs="*", default=["timm", "flashwin"], choices=VARIANTS)
    parser.add_argument("--python-road", action="store_true",
                        help="add the variant flashwin-python (host programs off: what the C++ extension gives, in "
                             "the same rounds; a line per group compares the two)")
    parser.add_argument("--recompute-qkv", nargs="*", default=None, metavar="PREFIX",
                        help="add a variant with patch_model's recompute_qkv: every module, or those whose "
                             "names start with a PREFIX (layers.1.: the second stage)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--repeats", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (the first compiles)")
    parser.add_argument("--sequential", action="store_true",
                        help="one variant after the other through benchmark_model (timm-flashwin bench)")
    parser.add_argument("--top", type=int, default=0, help="print the N largest host ops and GPU kernels per row")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/train_<gpu>_<commit>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    out = args.out or default_out(args.task)
    print(header(), flush=True)
    if not args.sequential:
        print(f"{'model':30s} {'b':>4s} {'mode':15s} {'variant':22s} {'img/s':>8s} {'wall ms':>8s} {'host ms':>8s} "
              f"{'GPU ms':>7s} {'launches':>8s} {'peak MiB':>8s}", flush=True)
    rows = []
    for name in args.models:
        for batch in args.batches or [MODELS[name][args.task == "train"]]:
            for mode in args.modes:
                if args.sequential:
                    rows += run_sequential(name, batch, mode, args)
                else:
                    group = run_group(name, batch, mode, args)
                    report(group, args.top)
                    report_host_programs(group)
                    rows += group
                write_json(out, rows)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
