"""Whole-model training speedups (patched / timm images per second) from bench_train.py's
JSON files, as one bar chart: a group per model and batch, a bar per mode.

    python benchmarks/plot_train.py benchmarks/results/train_eager_h100_7ac180a.json \\
        benchmarks/results/train_compile_b128_h100_7ac180a.json \\
        benchmarks/results/train_swin_tiny_h100_672e28a.json \\
        --out benchmarks/results/train_speedup_h100.png

Where several files hold the same (model, mode, batch), the first one named wins. Each
bar is labelled with its speedup and the peak-memory ratio; a mode not measured for a
model and batch has no bar, a note instead. Also prints the pairs as a table.
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHORT = {
    "swin_tiny_patch4_window7_224": "swin_tiny",
    "swinv2_tiny_window8_256": "swinv2_tiny",
    "swinv2_cr_tiny_224": "swinv2_cr_tiny",
}

Key = Tuple[str, str, int]  # (model, mode, batch)


def pairs(paths: List[str]) -> Dict[Key, Dict[str, dict]]:
    """(model, mode, batch) -> {"timm": row, "flashwin": row}, the first file's pair for each key."""
    found: Dict[Key, Dict[str, dict]] = {}
    for path in paths:
        here: Dict[Key, Dict[str, dict]] = {}
        for row in json.load(open(path)):
            here.setdefault((row["model"], row["mode"], row["batch"]), {})[row["variant"]] = row
        for key, variants in here.items():
            if key not in found and {"timm", "flashwin"} <= set(variants):
                found[key] = variants
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench_train.py JSON files, in order of preference")
    parser.add_argument("--out", default="train_speedup.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()

    found = pairs(args.files)
    modes = [m for m in ("eager", "compile", "reduce-overhead") if any(k[1] == m for k in found)]
    groups = sorted({(k[0], k[2]) for k in found}, key=lambda g: (list(SHORT).index(g[0]) if g[0] in SHORT else 99,
                                                                   g[0], g[1]))
    print(f"{'model':32} {'mode':16} {'batch':>5} {'timm img/s':>11} {'patched':>9} {'speedup':>8} {'peak':>6}")
    for model, batch in groups:
        for mode in modes:
            pair = found.get((model, mode, batch))
            if pair:
                t, f = pair["timm"], pair["flashwin"]
                print(f"{model:32} {mode:16} {batch:5d} {t['images_per_s']:11.1f} {f['images_per_s']:9.1f} "
                      f"{f['images_per_s'] / t['images_per_s']:7.2f}x {f['peak_mib'] / t['peak_mib']:5.2f}x")

    width = 0.8 / len(modes)
    colors = {"eager": "#4c72b0", "compile": "#dd8452", "reduce-overhead": "#55a868"}
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2, 4.2))
    for i, mode in enumerate(modes):
        for g, (model, batch) in enumerate(groups):
            pair = found.get((model, mode, batch))
            x = g + (i - (len(modes) - 1) / 2) * width
            if not pair:
                ax.text(x, 0.05, f"{mode}:\nnot\nmeasured", ha="center", va="bottom", fontsize=7, color="gray")
                continue
            t, f = pair["timm"], pair["flashwin"]
            speedup = f["images_per_s"] / t["images_per_s"]
            ax.bar(x, speedup, width, color=colors.get(mode), label=mode if g == 0 or mode not in
                   ax.get_legend_handles_labels()[1] else None)
            ax.text(x, speedup + 0.02, f"{speedup:.2f}x\n{f['peak_mib'] / t['peak_mib']:.2f} mem", ha="center",
                    va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{SHORT.get(m, m)}\nbatch {b}" for m, b in groups], fontsize=8)
    ax.set_ylabel("images/s, patched / timm")
    ax.set_ylim(0, max(f["images_per_s"] / t["images_per_s"] for t, f in
                       ((p["timm"], p["flashwin"]) for p in found.values())) * 1.25)
    device = next(iter(found.values()))["timm"].get("device", "")
    ax.set_title(args.title or f"AMP bf16 training steps, patched against timm ({device})", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
