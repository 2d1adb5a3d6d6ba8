"""examples/train_local.py runs as its docstring says and its own check holds: the frame
model trained with the local-attention operators (the Triton kernels, under the
interpreter on a CPU) has the losses of the same model on the PyTorch reference, step by
step, and its loss goes down. Small sizes: the interpreter runs every program in Python."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_local.py"


def test_train_local_losses_match_the_reference():
    command = [sys.executable, str(EXAMPLE), "--steps", "3", "--frames", "3", "--frame-tokens", "8", "--local", "8",
               "--dim", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--batch", "1", "--sinks", "2",
               "--window", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "losses match" in done.stdout, output[-4000:]
    # three steps printed: step, reference loss, flashwin loss, relative difference
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert len(rows) == 3 and all(float(row[3]) <= 1e-4 for row in rows), done.stdout
