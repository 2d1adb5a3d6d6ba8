"""Where a kernel's warps wait, from Nsight Compute's source page (SASS), as text.

    ncu --profile-from-start off --clock-control none --set full -k regex:dkdv -o w16 \\
        python benchmarks/profile_op.py --shapes w16_s1_b32 --kinds cosine --ncu
    ncu --import w16.ncu-rep --page source --csv --print-source sass -k regex:dkdv > dkdv.csv
    python benchmarks/ncu_stalls.py dkdv.csv

Prints the share of each stall reason among the warp-state samples, the instructions with
the most samples (with their two main reasons) and the samples per opcode. Where the CSV
holds several launches (the kernels launched once per mask kind), the one with the most
samples is summarized.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
from typing import List

SAMPLES = "Warp Stall Sampling (All Samples)"


def launches(path: str) -> List[List[List[str]]]:
    """The CSV's sections, one per profiled launch: [["Kernel Name", name], header, rows...]."""
    sections: List[List[List[str]]] = []
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            sections.append([row])
        elif sections:
            sections[-1].append(row)
    return sections


def _samples(section: List[List[str]]) -> int:
    header = section[1]
    return sum(int(r[header.index(SAMPLES)] or 0) for r in section[2:] if len(r) == len(header))


def summarize(section: List[List[str]], top: int) -> None:
    header = section[1]
    col = {name: i for i, name in enumerate(header)}
    rows = [r for r in section[2:] if len(r) == len(header)]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, name: int(r[col[name]] or 0)  # noqa: E731
    total = sum(count(r, SAMPLES) for r in rows)
    print(f"{section[0][1]}: {total} samples over {len(rows)} instructions")
    by_reason = collections.Counter({h: sum(count(r, h) for r in rows) for h in reasons})
    for reason, samples in by_reason.most_common(10):
        print(f"  {reason:26s} {100 * samples / max(total, 1):5.1f}%")
    print("  instructions with the most samples (index, samples, SASS, two main reasons)")
    for index, r in sorted(enumerate(rows), key=lambda ir: -count(ir[1], SAMPLES))[:top]:
        main = sorted(((count(r, h), h[len("stall_"):]) for h in reasons), reverse=True)[:2]
        print(f"  {index:5d} {count(r, SAMPLES):6d} {r[1].strip()[:58]:58s} "
              f"{main[0][1]} {main[0][0]}, {main[1][1]} {main[1][0]}")
    samples, executed = collections.Counter(), collections.Counter()
    for r in rows:
        opcode = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", r[1])
        if opcode:
            samples[opcode.group(2)] += count(r, SAMPLES)
            executed[opcode.group(2)] += count(r, "Instructions Executed")
    print("  per opcode, samples / warp instructions executed:")
    print("  " + ", ".join(f"{op} {n}/{executed[op]}" for op, n in samples.most_common(16)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    sections = [s for s in launches(args.csv) if len(s) > 2]
    if not sections:
        raise SystemExit(f"{args.csv}: no source-page section (was the report made with --set full?)")
    summarize(max(sections, key=_samples), args.top)


if __name__ == "__main__":
    main()
