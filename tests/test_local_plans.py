"""Which launch plans the local-attention kernels take (``kernels.local_plan.row_class``:
short, long and tall rows), and every plan built for sm_90, what the interpreter cannot
check (constexpr branches, loop-carried types, shared memory)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from timm_flashwin.kernels.local import plan as local_plan
from timm_flashwin.kernels.arch import INTERPRETER
from timm_flashwin.ops.local_reference import LocalPattern

LONG = local_plan.LONG_ROW_KEYS


@pytest.mark.parametrize("pattern,seq_len,long", [
    (LocalPattern.sliding(None, 0), LONG, True),  # causal: the last row sees all S keys
    (LocalPattern.sliding(None, 0), LONG - 1, False),
    (LocalPattern.sliding(None, None), LONG, True),
    (LocalPattern.sliding(512, 512), 1 << 20, False),
    (LocalPattern.sliding(LONG // 2, LONG // 2), 1 << 20, True),  # LONG + 1 keys
    (LocalPattern.sliding(LONG // 2 - 1, LONG // 2 - 1), 1 << 20, False),  # LONG - 1 keys
    (LocalPattern.blocks(256, 16), 1 << 20, False),  # 16 frames: 4096 keys
    (LocalPattern.blocks(256, 32), 1 << 20, True),  # the last query of a frame: 32 frames
    (LocalPattern.blocks(256, 4, LONG), 1 << 20, True),  # the sink's keys count
])
def test_long_row_plans_follow_the_widest_row(pattern, seq_len, long):
    """Which plans a pattern takes (long rows: taller query tiles on the GPU) depends on the
    most keys one of its rows may see, sink included, never more than S."""
    numbers = (pattern.period, pattern.before, pattern.after, pattern.sink)
    assert local_plan.long_rows(numbers, seq_len) is long


H100_SMS = 132


@pytest.mark.parametrize("pattern,seq_len,batch_heads,tall", [
    (LocalPattern.blocks(256, 16), 32768, 12, True),  # 3072 tall programs, 4096 keys a row
    (LocalPattern.blocks(256, 16), 16384, 12, False),  # 1536 programs: too few for 132 SMs
    (LocalPattern.blocks(256, 4, 64), 65536, 12, True),
    (LocalPattern.blocks(128, 8), 65536, 12, True),  # frames of one tall tile each
    (LocalPattern.blocks(1560, 3), 31200, 16, False),  # a tall tile would straddle two frames
    (LocalPattern.blocks(256, 3), 1 << 20, 12, False),  # 768 keys a row
    (LocalPattern.sliding(250, 249), 16384, 32, False),  # 500 keys a row
    (LocalPattern.sliding(512, 511), 16384, 64, True),  # 1024 keys a row
    (LocalPattern.sliding(512, 510), 16384, 64, False),  # 1023
    (LocalPattern.sliding(None, 0), 4096, 128, True),  # causal: up to S keys a row
    (LocalPattern.sliding(None, 0), 4096, 32, False),  # 1024 programs
    (LocalPattern.sliding(None, 0), 4096, 66, True),  # 32 x 66 = 2112 tall programs: 16 per SM
    (LocalPattern.sliding(None, 0), 4096, 65, False),  # 2080
    (LocalPattern.sliding(None, 0), 1000, 1 << 12, False),  # rows of fewer than 1024 keys
])
def test_tall_forward_tiles_take_wide_rows_in_large_grids(pattern, seq_len, batch_heads, tall):
    """The forward's 128-row tiles (``local_plan.tall_tiles``): rows of at least 1024 keys,
    frames that are whole tiles, and at least 16 tall programs per multiprocessor."""
    numbers = (pattern.period, pattern.before, pattern.after, pattern.sink)
    assert local_plan.tall_tiles(numbers, seq_len, seq_len, batch_heads, H100_SMS) is tall


def test_row_class_plans():
    """Long rows take precedence; under the interpreter (no GPU to count SMs) rows are never
    tall; a TALL class changes the forward's plan at head_dim 64 only (on the GPU's tables)."""
    causal = (1, -1, 1, 0)
    assert local_plan.row_class(causal, LONG, LONG, 1 << 12, INTERPRETER) == local_plan.LONG
    assert local_plan.row_class(causal, 4096, 4096, 1 << 12, INTERPRETER) == local_plan.SHORT
    default_plan = local_plan._default_plan.__wrapped__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_plan, "INTERPRET", False)
        tall = default_plan("fwd", 64, torch.bfloat16, local_plan.TALL)
        assert (tall.block_m, tall.block_n) == (local_plan.TALL_BLOCK_M, 64)
        for kind, width, dtype in (("dq", 64, torch.bfloat16), ("dkdv", 64, torch.bfloat16),
                                   ("fwd", 128, torch.bfloat16), ("fwd", 64, torch.float32)):
            assert (default_plan(kind, width, dtype, local_plan.TALL)
                    == default_plan(kind, width, dtype, local_plan.SHORT))


# ----------------------------------------------------------------------- the sm_90 build
@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="this triton build has no NVIDIA backend")
@pytest.mark.long
def test_kernels_compile_for_sm90():
    """What the interpreter cannot see (constexpr branches, loop-carried types, the plan's
    shared memory): the three kernels with sink, dropout and a sliding window's period built
    for sm_90, the forward with the plans of short, long and tall rows (tests/local_arch_build.py
    --smoke; the whole set without --smoke)."""
    script = Path(__file__).with_name("local_arch_build.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("registers") == 5, result.stdout  # the forward three times


def test_short_sequences_take_tiles_fitted_to_them():
    """``local_plan.fitted``: tiles no taller than the queries nor wider than the keys
    (powers of two, at least 16), at most 4 warps where fitted; long sequences keep the
    class's plan (on the GPU's tables). Hiera's pooling blocks: 4 or 16 queries, 16 or 64 keys."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_plan, "INTERPRET", False)
        local_plan._default_plan.cache_clear()
        try:
            for kind in ("fwd", "dq", "dkdv"):
                full = local_plan.plan(kind, 96, torch.bfloat16)
                assert local_plan.plan(kind, 96, torch.bfloat16, local_plan.SHORT, 16384, 16384) == full
                tiles = local_plan.plan(kind, 96, torch.bfloat16, local_plan.SHORT, 4, 16)
                assert (tiles.block_m, tiles.block_n, tiles.num_stages) == (16, 16, full.num_stages)
                assert tiles.num_warps == min(full.num_warps, 4)
                tiles = local_plan.plan(kind, 96, torch.bfloat16, local_plan.SHORT, 49, 196)
                assert (tiles.block_m, tiles.block_n) == (min(full.block_m, 64), min(full.block_n, 256))
        finally:
            local_plan._default_plan.cache_clear()
