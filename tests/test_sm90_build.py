"""The kernels build for a Hopper GPU, checked without one (see sm90_build.py): what the
interpreter cannot check in CI, such as constexpr branches and loop-carried types."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("sm90_build.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no NVIDIA backend")
def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # 10 cases: 3 one-tile (forward + fused backward), 7 multi-block (the dkdv kernel with
    # atomic dQ and without, the dQ finish and dq kernels, the dbias kernel adding its sums
    # or writing partials, and the forward where it streams key blocks too, N=100 excepted);
    # the inference forward (no statistics) of the five streaming cases without dropout; all
    # as launched: 16-bit inputs read the mask folded into their float16 bias copy where it
    # is small, else (N=1024) and with float32 inputs its region ids, one build per mask kind
    # (forward and dkdv kernel); the copy; and the feature-map layout of the forward where it
    # reads one key block or runs without statistics, and of the fused backward: block windows
    # (MAPPED 1) and, for the three one-tile cases of 49 and 64 tokens, MaxViT's strided grid
    # windows (MAPPED 2): 89 builds
    built = [line for line in result.stdout.splitlines() if line.startswith(("  window_attention_", "  float16_"))]
    assert len(built) == 89 and all("registers" in line for line in built), result.stdout
