"""transformers' Swin models, patched against transformers' own default attention: training
and inference steps, eager and torch.compile, the host's and the GPU's time per step.

    python benchmarks/bench_hf.py --models swin-tiny --tasks train            # the GPU
    python benchmarks/bench_hf.py --smoke --out /tmp/bench_hf.json            # CPU, tiny

Models (random weights from their configs: timing does not depend on the values):

* ``swin-tiny``: SwinForImageClassification, ``SwinConfig()`` (microsoft/swin-tiny-patch4-
  window7-224's configuration), 224x224, batch 64 (training) / 128 (inference).
* ``donut-encoder``: DonutSwinModel with naver-clova-ix/donut-base's encoder configuration
  (embed_dim 128, depths 2-2-14-2, heads 4-8-16-32, window 10) at ``--donut-size`` (default
  1280x960; the published model reads 2560x1920), batch 2 / 4.

Variants: ``transformers`` (the model as transformers builds it: Swin's SDPA interface in
5.x, DonutSwin's eager math) and ``flashwin`` (the same model, ``patch_model``). Tasks:
``train`` (AMP bfloat16 steps: forward, cross-entropy on the flattened first output,
backward, AdamW; ``timm_flashwin.tools.bench``'s step) and ``infer`` (bfloat16 weights,
inference_mode). Modes: ``eager`` and ``compile`` (torch.compile's default mode).

Per (model, task, mode) the variants are warmed up, then timed in alternating rounds
(``common.alternating_rounds``): ``wall_ms`` per step back to back, ``host_ms`` to
enqueue one step with the GPU idle, ``gpu_ms`` and ``launches`` per step under
torch.profiler, ``peak_mib``, and ``speedup_rounds`` (transformers / flashwin wall time
within each round). Writes --out (default benchmarks/results/hf_<gpu>_<commit>.json) after
every group.

``--smoke`` runs the same code on the CPU with tiny configurations, one round of one step,
in eager mode, without warm-up or profile: torch.cuda.synchronize is then a no-op (nothing
runs asynchronously) and the GPU columns are 0 (tests/test_bench_hf.py).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
from typing import Dict, List, Tuple
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from common import alternating_rounds, default_out, environment, header, peak_mib, profile, warm_up, write_json  # noqa
from timm_flashwin import patch_model, patch_report  # noqa: E402
from timm_flashwin.tools.bench import _step_fn  # noqa: E402
from timm_flashwin.tools.hf_models import HfImageModel  # noqa: E402

#: model -> (model class, config class, config arguments, (training batch, inference batch))
MODELS: Dict[str, Tuple[str, str, dict, Tuple[int, int]]] = {
    "swin-tiny": ("SwinForImageClassification", "SwinConfig", {}, (64, 128)),
    "donut-encoder": ("DonutSwinModel", "DonutSwinConfig",
                      dict(embed_dim=128, depths=[2, 2, 14, 2], num_heads=[4, 8, 16, 32], window_size=10), (2, 4)),
}
#: --smoke: every model at this size (one 8x8 map of 4x4 windows, two blocks), batch 1
SMOKE_CONFIG = dict(image_size=16, patch_size=2, embed_dim=16, depths=[2], num_heads=[2], window_size=4)
MODES = {"eager": False, "compile": True}
TASKS = ("train", "infer")


def build(name: str, donut_size: Tuple[int, int], smoke: bool) -> HfImageModel:
    """``name``'s model (``MODELS``), random weights, drop path off."""
    import transformers
    model_class, config_class, arguments, _ = MODELS[name]
    arguments = dict(arguments, drop_path_rate=0.0)
    if name == "donut-encoder":
        arguments["image_size"] = list(donut_size)
    if smoke:
        arguments.update(SMOKE_CONFIG)
    config = getattr(transformers, config_class)(**arguments)
    torch.manual_seed(0)
    return HfImageModel(getattr(transformers, model_class)(config))


def run_group(name: str, task: str, mode: str, args) -> List[dict]:
    """Both variants of one (model, task, mode), timed in alternating rounds."""
    device = "cpu" if args.smoke else "cuda"
    base = build(name, tuple(args.donut_size), args.smoke)
    batch = 1 if args.smoke else MODELS[name][3][TASKS.index(task)]
    train = task == "train"
    images = torch.randn(batch, 3, *base.pretrained_cfg["input_size"][1:], device=device)
    steps, models = {}, {}
    for variant in ("transformers", "flashwin"):
        model = copy.deepcopy(base).to(device).train(train)
        if variant == "flashwin":
            patch_model(model, strict=True)
        if not train:
            model = model.to(torch.bfloat16)
        runnable = torch.compile(model) if MODES[mode] else model
        steps[variant] = _step_fn(runnable, images if train else images.to(torch.bfloat16), torch.bfloat16, train)
        models[variant] = model
        warm_up(steps[variant], args.warmup, f"{name} {task} {mode} {variant}")
    timings = alternating_rounds(steps, args.rounds, args.repeats)
    rows = []
    for variant, step in steps.items():
        wall, host = (statistics.median(t) for t in timings[variant])
        launches, gpu_ms, _, gpu_kernels = (0, 0.0, [], []) if args.smoke else profile(step, 2, 10)
        rows.append(dict(model=name, task=task, mode=mode, variant=variant, batch=batch,
                         image_size=list(images.shape[-2:]), wall_ms=wall, host_ms=host, gpu_ms=gpu_ms,
                         launches=launches, peak_mib=0.0 if args.smoke else peak_mib(models[variant], step, train),
                         patched_modules=len(patch_report(models[variant]).patched), wall_ms_rounds=timings[variant][0],
                         gpu_kernels=gpu_kernels,
                         **dict(environment(), **(dict(device="cpu") if args.smoke else {}))))
    ratios = [t / p for t, p in zip(timings["transformers"][0], timings["flashwin"][0])]
    rows[1].update(speedup_rounds=ratios, speedup_round_median=statistics.median(ratios))
    torch._dynamo.reset()
    if not args.smoke:
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/hf_<gpu>_<commit>.json")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--donut-size", nargs=2, type=int, default=[1280, 960], metavar=("H", "W"))
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--repeats", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (the first compiles)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, eager, one step a round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.repeats, args.warmup, args.modes = 1, 1, 0, ["eager"]
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    out = args.out or default_out("hf")
    print(header(), flush=True)
    rows: List[dict] = []
    # --smoke: the CPU runs each step synchronously; the timing helpers' CUDA synchronizations have nothing to wait for
    no_gpu = mock.patch("torch.cuda.synchronize", lambda *a, **k: None) if args.smoke else contextlib.nullcontext()
    with no_gpu:
        for name in args.models:
            for task in args.tasks:
                for mode in args.modes:
                    group = run_group(name, task, mode, args)
                    rows += group
                    theirs, ours = group
                    print(f"{name} {task} {mode}: wall {theirs['wall_ms']:.2f} -> {ours['wall_ms']:.2f} ms "
                          f"(rounds median {ours['speedup_round_median']:.2f}x), GPU {theirs['gpu_ms']:.2f} -> "
                          f"{ours['gpu_ms']:.2f} ms, host {theirs['host_ms']:.2f} -> {ours['host_ms']:.2f} ms",
                          flush=True)
                    write_json(out, rows)
    return rows


if __name__ == "__main__":
    main()
