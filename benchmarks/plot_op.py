"""PNG plots of an op benchmark (benchmarks/bench_op.py --out FILE).

    python benchmarks/plot_op.py benchmarks/results/op_h200.json
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = ["eager", "sdpa", "compile", "flex", "ours", "fwa", "fwa2"]  # bench_op.py's, the published kernels last


def plot(path: str) -> None:
    data = json.load(open(path))
    rows, meta = data["rows"], data["meta"]
    cases = list(dict.fromkeys((r["shape"], r["kind"]) for r in rows))
    for key, title in (("fwd_us", "forward"), ("fwdbwd_us", "forward + backward")):
        fig, ax = plt.subplots(figsize=(12, 4.5))
        impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.get(key, float("nan")) for r in rows if (r["shape"], r["kind"]) == c and r["impl"] == impl),
                         float("nan")) for c in cases]
            ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(cases))], vals, width, label=impl)
        floor_key = "floor_fwd_us" if key == "fwd_us" else "floor_fwdbwd_us"
        floors = [next(r[floor_key] for r in rows if (r["shape"], r["kind"]) == c) for c in cases]
        ax.scatter(range(len(cases)), floors, marker="_", s=400, color="black", zorder=3, label="byte floor")
        ax.set_yscale("log")
        ax.set_ylabel("microseconds (log)")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{s}\n{k}" for s, k in cases], fontsize=8)
        ax.set_title(f"window attention {title}, bf16, {meta['device']}, torch {meta['torch']} ({meta['date']})")
        ax.legend(ncol=len(impls) + 1, fontsize=8)
        fig.tight_layout()
        out = f"{os.path.splitext(path)[0]}_{key.replace('_us', '')}.png"  # next to the JSON, named after it
        fig.savefig(out, dpi=110)
        print(out)


if __name__ == "__main__":
    plot(sys.argv[1])
