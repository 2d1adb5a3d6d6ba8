"""benchmarks/bench_train.py's comparison of the host programs with the Python road
(``--python-road``): the line it prints per group from the rows it writes (GPU runs: the
lead's; here the arithmetic on rows of that form)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_train import report_host_programs  # noqa: E402


def test_the_host_programs_line(capsys):
    rows = [dict(variant="timm", wall_ms=40.0, host_ms=60.0, gpu_ms=35.0),
            dict(variant="flashwin", wall_ms=25.0, host_ms=45.0, gpu_ms=22.0, host_programs_rounds=[1.1, 1.3, 1.2],
                 host_programs_round_median=1.2),
            dict(variant="flashwin-python", wall_ms=30.0, host_ms=51.0, gpu_ms=22.5)]
    report_host_programs(rows)
    line = " ".join(capsys.readouterr().out.split())
    assert line == ("host programs vs Python road: wall 30.00 -> 25.00 ms (1.20x; rounds 1.10x to 1.30x, median "
                    "1.20x), host 51.0 -> 45.0 ms, GPU 22.5 -> 22.0 ms")
    report_host_programs(rows[:2])  # without the Python road's variant: nothing to compare
    assert capsys.readouterr().out == ""
