"""The plots of benchmarks/bench_local.py: time against S per case, from its rows (it calls
``plot`` after a run with --out), or again from its JSON file:

    python benchmarks/plot_local.py benchmarks/results/local_causal_frames_h100_ed1620a.json
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List


def plot(rows: List[Dict], out: str) -> None:
    """One PNG per case next to ``out`` (``<out>_<case>.png``): ms against S, log-log, a line per
    implementation, forward and forward + backward side by side."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="a bench_local.py --out file; the PNGs are written next to it")
    args = parser.parse_args()
    with open(args.json) as f:
        plot(json.load(f)["rows"], args.json)


if __name__ == "__main__":
    main()
