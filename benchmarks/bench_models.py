"""Whole timm models, unpatched against patched, eager and torch.compile.

    python benchmarks/bench_models.py --out results/models.json [--compile] [--train]

Models and batch sizes of the performance issues: the three tiny Swin models and one model
of each other window-attention family at batch 128 (inference, bf16 weights) and 64
(AMP-bf16 training steps), and swinv2_base_window12to24_192to384 at 32 / 16. Uses timm_flashwin.tools.bench (the same code
as ``timm-flashwin bench``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, write_json  # noqa: E402
from timm_flashwin.tools.bench import benchmark_model, recompute_qkv_option  # noqa: E402

MODELS = {  # name: (inference batch, training batch)
    "swin_tiny_patch4_window7_224": (128, 64),
    "swinv2_tiny_window8_256": (128, 64),
    "swinv2_cr_tiny_224": (128, 64),
    "swinv2_base_window12to24_192to384": (32, 16),
    # the other window-attention families: MaxViT, CoAtNet, GCViT, TinyViT, then the plain
    # windows (no bias): DaViT, Twins-SVT, NesT, Hiera
    "maxvit_tiny_tf_224": (128, 64),
    "coatnet_0_rw_224": (128, 64),
    "gcvit_tiny": (128, 64),
    "tiny_vit_21m_224": (128, 64),
    "davit_tiny": (128, 64),
    "twins_svt_small": (128, 64),
    "nest_tiny": (128, 64),
    "hiera_tiny_224": (128, 64),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--modes", nargs="*", default=["infer", "train"], choices=["infer", "train"])
    parser.add_argument("--compile", action="store_true", help="torch.compile both sides")
    parser.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune"],
                        help="torch.compile's mode, with --compile (reduce-overhead: CUDA graphs)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--recompute-qkv", nargs="*", default=None, metavar="NAME_PREFIX",
                        help="also time the model patched with recompute_qkv=True (a third variant); with "
                             "names, recompute_qkv only for the modules whose qualified names start with one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.models:
        for mode in args.modes:
            batch = MODELS[name][mode == "train"]
            r = benchmark_model(name, batch=batch, dtype="bfloat16", train=mode == "train", compile=args.compile,
                                compile_mode=args.compile_mode, warmup=args.warmup, repeats=args.repeats,
                                recompute_qkv=recompute_qkv_option(args.recompute_qkv))
            results.append(dict(r.to_dict(), code=code_version()))
            runs = "  ".join(f"{x.variant}: {x.images_per_s:8.1f} img/s {x.peak_mib:7.0f} MiB (first {x.first_iter_s:.1f}s)"
                             for x in r.runs)
            print(f"{name:36s} {mode:5s} b{batch:<4d} {runs}  speedup {r.speedup():.2f}x", flush=True)
            if args.out:
                write_json(args.out, results)


if __name__ == "__main__":
    main()
