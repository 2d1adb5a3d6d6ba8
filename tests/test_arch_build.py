"""The kernels build for the GPUs the plans serve, checked without one: for a Hopper GPU every
build case (arch_build.py), what the interpreter cannot check in CI, such as constexpr
branches and loop-carried types; for sm_80 to sm_120 the configurations the plans choose
that come nearest their architecture's shared memory (plan_fits.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from arch_build import CASES

SCRIPT = Path(__file__).with_name("arch_build.py")
FITS_SCRIPT = Path(__file__).with_name("plan_fits.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

# 10 cases: 3 one-tile (forward + fused backward), 7 multi-block (the dkdv kernel with
# atomic dQ and without, the dQ finish and dq kernels, the dbias kernel adding its sums
# or writing partials, and the forward where it streams key blocks too, N=100 excepted);
# the inference forward (no statistics) of the five streaming cases without dropout; all
# as launched: 16-bit inputs read the mask folded into their float16 bias copy where it
# is small, else (N=1024) and with float32 inputs its region ids, one build per mask kind
# (forward and dkdv kernel); the copy; and the feature-map layout of the forward where it
# reads one key block or runs without statistics, and of the fused backward: block windows
# (MAPPED 1) and, for the three one-tile cases of 49 and 64 tokens, MaxViT's strided grid
# windows (MAPPED 2); with queries of their own (GCViT's global query, arch_build.SHARED_QUERY) the
# forward and fused backward of case 0, the forward and the five multi-block kernels of
# case 4: 96 builds. In four processes, which pytest-xdist spreads over its
# workers: in one (181 s on a 2-core machine with Triton's cache cold) the test often
# started late and kept one worker busy after the other had finished.
#: group -> (CASES indices, "copy" for the bias copy; the builds they make)
GROUPS = {"cases-0-2": ((0, 1, 2), 26), "cases-3-5": ((3, 4, 5), 34), "cases-6-7": ((6, 7), 18),
          "cases-8-9-copy": ((8, 9, "copy"), 18)}


def test_groups_build_every_case_once():
    indices = [i for cases, _ in GROUPS.values() for i in cases if i != "copy"]
    assert sorted(indices) == list(range(len(CASES)))
    assert sum(builds for _, builds in GROUPS.values()) == 96


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no NVIDIA backend")
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.long
def test_kernels_compile_for_sm90(group):
    cases, expected = GROUPS[group]
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, cases)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    built = [line for line in result.stdout.splitlines() if line.startswith(("  window_attention_", "  float16_"))]
    assert len(built) == expected and all("registers" in line for line in built), result.stdout


#: the configurations per code-generation family (sm_80/86/89, sm_90, sm_100, sm_120) whose
#: estimated shared memory comes nearest their budget, built in FITS_PARTS processes
NEAREST, FITS_PARTS = 12, 4


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no NVIDIA backend")
@pytest.mark.parametrize("part", range(FITS_PARTS))
@pytest.mark.long
def test_planned_configurations_fit_their_architectures(part):
    """Each build within the smallest shared memory of the architectures whose plans chose it,
    the estimate the plans fitted to (kernels/budget.py) at least what the compiler allocates,
    and sm_80, sm_86 and sm_89 allocating alike (plan_fits.py)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, str(FITS_SCRIPT), "--nearest", str(NEAREST), "--part",
                             f"{part}/{FITS_PARTS}"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(", shared " in line for line in lines) == 4 * NEAREST // FITS_PARTS, result.stdout
    assert sum("the same build for" in line for line in lines) == (6 if part == 0 else 0), result.stdout
