"""The plots README.md and RESULTS.md show, from the benchmarks' raw JSON files.

    python benchmarks/plot.py op benchmarks/results/op_published_h100_64f9b87.json    # <file>_fwd.png, _fwdbwd.png
    python benchmarks/plot.py train A.json B.json ... --out benchmarks/results/train_speedup_h100.png
    python benchmarks/plot.py local benchmarks/results/local_frames_h100_3fe5554.json  # <file>_<case>.png

``op``: bench_op.py's times per case, a bar per implementation, the byte floor marked, log
scale. ``train``: bench_train.py's speedups (patched / timm images per second), a group per
model and batch, a bar per mode, labelled with the speedup and the peak-memory ratio; where
several files hold one (model, mode, batch), the first named wins; also prints the pairs.
``local``: bench_local.py's ms against S per case (bench_local.py draws them after a run).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List

OP_IMPLS = ["eager", "sdpa", "compile", "flex", "ours", "fwa", "fwa2"]  # bench_op.py's, the published last
SHORT = {"swin_tiny_patch4_window7_224": "swin_tiny", "swinv2_tiny_window8_256": "swinv2_tiny",
         "swinv2_cr_tiny_224": "swinv2_cr_tiny"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_op(path: str) -> None:
    plt = _pyplot()
    data = json.load(open(path))
    rows, meta = data["rows"], data["meta"]
    cases = list(dict.fromkeys((r["shape"], r["kind"]) for r in rows))
    impls = [i for i in OP_IMPLS if any(r["impl"] == i for r in rows)]
    for key, title in (("fwd_us", "forward"), ("fwdbwd_us", "forward + backward")):
        fig, ax = plt.subplots(figsize=(12, 4.5))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.get(key, float("nan")) for r in rows if (r["shape"], r["kind"]) == c and r["impl"] == impl),
                         float("nan")) for c in cases]
            ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(cases))], vals, width, label=impl)
        floor = "floor_" + key
        ax.scatter(range(len(cases)), [next(r[floor] for r in rows if (r["shape"], r["kind"]) == c) for c in cases],
                   marker="_", s=400, color="black", zorder=3, label="byte floor")
        ax.set_yscale("log")
        ax.set_ylabel("microseconds (log)")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{s}\n{k}" for s, k in cases], fontsize=8)
        ax.set_title(f"window attention {title}, bf16, {meta['device']}, torch {meta['torch']} ({meta['date']})")
        ax.legend(ncol=len(impls) + 1, fontsize=8)
        fig.tight_layout()
        out = f"{os.path.splitext(path)[0]}_{key.replace('_us', '')}.png"
        fig.savefig(out, dpi=110)
        print(out)


def train_pairs(paths: List[str]) -> Dict:
    """(model, mode, batch) -> {"timm": row, "flashwin": row}, the first file's pair for each."""
    found: Dict = {}
    for path in paths:
        here: Dict = {}
        for row in json.load(open(path)):
            here.setdefault((row["model"], row["mode"], row["batch"]), {})[row["variant"]] = row
        for key, variants in here.items():
            if key not in found and {"timm", "flashwin"} <= set(variants):
                found[key] = variants
    return found


def plot_train(paths: List[str], out: str, title=None) -> None:
    plt = _pyplot()
    found = train_pairs(paths)
    modes = [m for m in ("eager", "compile", "reduce-overhead") if any(k[1] == m for k in found)]
    groups = sorted({(k[0], k[2]) for k in found},
                    key=lambda g: (list(SHORT).index(g[0]) if g[0] in SHORT else 99, g[0], g[1]))
    print(f"{'model':32} {'mode':16} {'batch':>5} {'timm img/s':>11} {'patched':>9} {'speedup':>8} {'peak':>6}")
    for (model, mode, batch), pair in sorted(found.items()):
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
            ax.bar(x, speedup, width, color=colors[mode],
                   label=mode if mode not in ax.get_legend_handles_labels()[1] else None)
            ax.text(x, speedup + 0.02, f"{speedup:.2f}x\n{f['peak_mib'] / t['peak_mib']:.2f} mem", ha="center",
                    va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{SHORT.get(m, m)}\nbatch {b}" for m, b in groups], fontsize=8)
    ax.set_ylabel("images/s, patched / timm")
    ax.set_ylim(0, max(p["flashwin"]["images_per_s"] / p["timm"]["images_per_s"] for p in found.values()) * 1.25)
    device = next(iter(found.values()))["timm"].get("device", "")
    ax.set_title(title or f"AMP bf16 training steps, patched against timm ({device})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def plot_local(rows: List[Dict], out: str) -> None:
    """One PNG per case next to ``out`` (``<out>_<case>.png``): ms against S, log-log, a line
    per implementation, forward and forward + backward side by side."""
    try:
        plt = _pyplot()
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    for case in dict.fromkeys(r["case"] for r in rows):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in zip(axes, ("fwd_ms", "fwdbwd_ms"), ("forward", "forward + backward")):
            for impl in dict.fromkeys(r["impl"] for r in rows):
                points = sorted((r["S"], r[key]) for r in rows if r["case"] == case and r["impl"] == impl and key in r)
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("S")
            ax.set_ylabel("ms")
            ax.set_title(f"{case}: {title}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{os.path.splitext(out)[0]}_{case}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    sub.add_parser("op", help="bench_op.py's JSON").add_argument("file")
    train = sub.add_parser("train", help="bench_train.py's JSON files, in order of preference")
    train.add_argument("files", nargs="+")
    train.add_argument("--out", default="train_speedup.png")
    train.add_argument("--title", default=None)
    sub.add_parser("local", help="bench_local.py's JSON").add_argument("file")
    args = parser.parse_args(argv)
    if args.kind == "op":
        plot_op(args.file)
    elif args.kind == "train":
        plot_train(args.files, args.out, args.title)
    else:
        plot_local(json.load(open(args.file))["rows"], args.file)


if __name__ == "__main__":
    main()
