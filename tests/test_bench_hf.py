"""benchmarks/bench_hf.py in its --smoke setting (tiny models on the CPU, the kernels under
the interpreter): both variants of each group run and land in the JSON it writes, the
patched one with its modules patched."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_hf  # noqa: E402


def test_smoke_writes_both_variants_of_each_group(tmp_path):
    rows = bench_hf.main(["--smoke", "--out", str(tmp_path / "hf.json"), "--models", "donut-encoder"])
    assert json.loads((tmp_path / "hf.json").read_text()) == rows
    assert [(r["task"], r["variant"], r["patched_modules"]) for r in rows] == [
        ("train", "transformers", 0), ("train", "flashwin", 2), ("infer", "transformers", 0), ("infer", "flashwin", 2)]
    assert all(r["wall_ms"] > 0 and r["image_size"] == [16, 16] for r in rows)
    assert all(len(r["speedup_rounds"]) == 1 for r in rows if r["variant"] == "flashwin")
