"""Launch configurations: tile sizes, warps, pipeline depth and how the windows are split
into programs, per pass and (N, head_dim, dtype, cosine).

Nothing here depends on the number of windows B_, nW or a scale value: a new batch size
never recompiles a kernel (the window split is a run-time argument).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from .. import budget
from ..arch import INTERPRET, Arch
from ..sizes import cdiv, tile_side


@dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched.

    block_n >= N means a whole window per key block: the forward then reads the bias and
    mask tile once per program, and the backward runs the fused one-tile kernel.
    programs_per_sm: the windows sharing a (head, mask window) are split into chunks so
    that about this many programs run per SM; each program loops over its chunk.
    """

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    #: cap on registers per thread (Triton's ``maxnreg``), None for the compiler's choice;
    #: applied where the kernels are launched directly (``launcher.launch_options``)
    maxnreg: Optional[int] = None
    #: multi-block backward: dQ added up by the dkdv kernel with atomic adds rather than by
    #: a dq kernel of its own (``plan.dq_by_atomic_adds``; never in deterministic mode)
    dq_atomic: bool = False
    #: multi-block backward: the bias gradient added up by the dkdv kernel with atomic adds
    #: into this many (H, N, N) slots (0: by a dbias kernel of its own;
    #: ``plan.dbias_slots``; never in deterministic mode)
    dbias_slots: int = 0
    #: kernels that stream key blocks over the region ids of a mask: a second copy of the key
    #: loop, built without a mask, for the windows of one region (``bias_mask_tiles.window_in_one_region``)
    one_region_loop: bool = False
    #: the forward and the dkdv kernel: one loop over (window, key block) steps rather than a
    #: loop over blocks per window (``forward.forward_windows``, ``backward_dkdv.dkdv_windows``)
    flat_loop: bool = False

    def single_tile(self, n: int) -> bool:
        return self.block_m >= n and self.block_n >= n


#: (pass, N, head_dim, dtype, cosine) -> LaunchConfig, consulted before the defaults; pass is
#: "fwd", "bwd" or "dbias" (the multi-block backward's dbias kernel, ``dbias_config``).
#: Tests fill it to run a configuration. The sweeps quoted in this file filled it from a tuning
#: script removed at fc2fe00 (``git show fc2fe00^:benchmarks/tune_op.py``), kernels alone.
OVERRIDES: Dict[Tuple[str, int, int, torch.dtype, bool], LaunchConfig] = {}

#: Whether the kernels that stream key blocks compute a region-structured mask from
#: region ids (bias_mask.mask_structure) rather than read it; off, it measures what that saves.
MASK_REGIONS = True

#: The largest float16 copy of bias + mask, (nW, H, N, N), into which the launcher folds a
#: mask for the kernels that stream key blocks with 16-bit inputs (``bias_mask.folds_mask``);
#: beyond it they read the mask's region ids. H200, bf16, the whole op (bench_op.py, 3
#: alternated rounds, 2026-11-24): copies of 2.6 MB (window 12) and 6.3 MB (window 16)
#: took f+b 12% and 6% off (V1); one of 42.5 MB (window 24, (256, 4, 576, 32)) still took
#: 2% (V1) and 4% (cosine) off the f+b but made the forward 3% slower (the copy)
#: and the f+b's peak 37.6 MiB higher, above FlexAttention's.
FOLDED_MASK_MAX_BYTES = 16 << 20


def _streamed_block(n: int, block: int) -> int:
    """The block of a kernel that streams blocks of a window of n tokens. Under the
    interpreter (CI), windows of more than 128 tokens take blocks of 128: its cost is per
    operation, not per element, and the paths stay those of the GPU (N <= 64: one tile;
    64 < N <= 128: the same configurations as on the GPU; N > 128: several blocks, the
    last one partial). The multi-block tests and model tests then run 2 to 4 times faster."""
    return 128 if INTERPRET and n > 128 else block


def _streamed_maxnreg(block_d: int, dtype: torch.dtype) -> Optional[int]:
    """The register cap of the kernels that stream key blocks (64x64 tiles, 4 warps).

    Left to itself the compiler takes 222 to 255 registers per thread: two programs per
    SM. Capped at 168, three fit (the region-mask forward's 62 to 70 KB of shared memory
    too), for 12 to 70 bytes of spilled registers per thread. H100, bf16, D = 32, cap
    against none in one run (2026-11-23), forward / backward us: window 24 V1 618 -> 546 /
    1361 -> 1300, cosine 844 -> 712 / 2210 -> 1947; window 16 V1 218 -> 205 / 467 -> 449, cosine 279 -> 259 /
    745 -> 658; window 12 V1 196 -> 188 / 394 -> 376, cosine 242 -> 242 / 627 -> 552.
    Measured for head_dim 32 and 16-bit inputs only; float32 products take other registers.
    """
    return 168 if block_d <= 32 and dtype != torch.float32 else None


def _cached(function):
    """``functools.lru_cache`` for eager calls; while dynamo traces (``plan.call_plan``,
    which ``window_attention`` asks under torch.compile too) the function itself: dynamo
    traces through a cache regardless and warns of each one it meets."""
    cached = functools.lru_cache(maxsize=None)(function)

    @functools.wraps(function)
    def lookup(*args):
        return function(*args) if torch.compiler.is_compiling() else cached(*args)
    lookup.cache_clear = cached.cache_clear
    return lookup


def forward_config(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool = False,
                   reads_mask: bool = True, arch: Optional[Arch] = None) -> Optional[LaunchConfig]:
    """dropout: with attention dropout (its random numbers take registers); reads_mask:
    whether a kernel that streams key blocks reads a mask itself (region ids or dense),
    not where there is none or it is folded into the bias copy (``bias_mask.folds_mask``);
    arch: the device's limits (``arch.device_arch``; None: the tuned configuration as it is),
    which the configuration is fitted to (``budget.window_fit``). None where nothing fits
    (``fits``). OVERRIDES apply as they are."""
    n, head_dim = int(n), int(head_dim)  # compile-time constants of the kernels, even when traced
    found = OVERRIDES.get(("fwd", n, head_dim, dtype, cosine))
    if found is not None:
        return found
    tuned = _default_forward_config(n, head_dim, dtype, cosine, dropout, reads_mask)
    return _fitted_forward(tuned, n, dtype, reads_mask, arch)


@_cached
def _fitted_forward(tuned: LaunchConfig, n: int, dtype: torch.dtype, reads_mask: bool,
                    arch: Optional[Arch]) -> Optional[LaunchConfig]:
    """The forward's ``tuned`` configuration fitted to ``arch``; a window of one tile whose
    tile does not fit streams key blocks of half the window's tile instead."""
    elem, mask_bytes = dtype.itemsize, 4 if reads_mask else 0
    fitted = budget.window_fit("fwd", tuned, n, elem, mask_bytes, arch)
    if fitted is None and n <= tuned.block_n and tile_side(n) // 2 >= budget.MIN_BLOCK:
        half = tile_side(n) // 2
        fitted = budget.window_fit("fwd", replace(tuned, block_m=half, block_n=half, flat_loop=False), n, elem,
                                   mask_bytes, arch)
    return fitted


@_cached  # pure, and looked up several times per call of the op
def _default_forward_config(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool,
                            reads_mask: bool) -> LaunchConfig:
    block_d = tile_side(head_dim)
    # Tiles shrink as head_dim grows, to stay within registers and shared memory.
    # Measured on an H200 (2026-11-22): 4 warps and 3 stages beat
    # 8 warps or fewer stages on every N <= 64 shape, by 1.1x to 2x.
    max_block = 64 if block_d <= 64 else 32
    stages = 3 if block_d <= 64 else 1
    if n <= max_block:
        block = tile_side(n)
        return LaunchConfig(block, block, block_d, 4, stages, 8, flat_loop=True)
    if n <= 128 and block_d <= 32:
        return LaunchConfig(64, 128, block_d, 4, 2, 8, flat_loop=True)
    # N > 128, D = 32 on an H200 (2026-11-22, dense mask): 64x64, 4 warps,
    # 3 stages beat 2 stages by 1.1x to 1.2x and 128x64, 64x128, 32x64 or 8 warps by more
    # (before the flat loop; window 16 takes 64x128 since: ``_wide_key_blocks``).
    # Wider heads keep the shallower pipelines (shared memory).
    stages = 3 if block_d <= 32 else 2 if block_d <= 64 else 1
    if _wide_key_blocks(n, block_d, dtype) and not dropout:
        block_m = _streamed_block(n, 64)
        return LaunchConfig(block_m, 128, block_d, 4, 3, 8, None if cosine else 200,
                            one_region_loop=not cosine, flat_loop=True)
    block = _streamed_block(n, max_block)
    # V1 without mask arithmetic runs uncapped: H200, bf16, window 12 (512, 4, 144, 32), the
    # mask folded, forward kernel alone (2026-11-24): 71.9 us capped at
    # 168 (154 registers used), 63.0 uncapped (128 registers, no spills); cosine keeps the
    # cap (104.2 against 110.2 us uncapped, 208 to 218 registers).
    maxnreg = None if not reads_mask and not cosine else _streamed_maxnreg(block_d, dtype)
    return LaunchConfig(block, block, block_d, 4, stages, 8, maxnreg,
                        one_region_loop=_one_region_loop(n, block), flat_loop=_flat_loop(n, block, block_d))


def _wide_key_blocks(n: int, block_d: int, dtype: torch.dtype) -> bool:
    """Whether the forward of windows of n tokens takes key blocks of 128 (query blocks of
    64, 4 warps, a flat loop): where n is a multiple of 128 with at most 4 such blocks
    (window 16: 256 tokens), head_dim <= 32 and 16-bit inputs. Half the steps of 64x64
    tiles, each twice as long, so the per-step latencies (the q tile's load, the softmax's
    row reductions) are hidden behind twice the work. Register cap 200 for V1 (192 used,
    no spills; two programs per SM either way), none for cosine (255 used, 0 spills; a
    cap of 200 spilled 34 B and took 142 us). H200, bf16, D = 32, window 16 (512, 3, 256,
    32), forward kernels alone (2026-11-24),
    64x64 capped at 168 (the default before) -> 64x128, us: V1 98.1 -> 88.4, cosine
    126.0 -> 124.1; without statistics (uncapped) 94.8 -> 86.9 and 114.3 ->
    108.3. Whole op, 4 alternated rounds (bench_op.py --impls ours), forward (no_grad) /
    f+b us: V1 97.8 -> 89.3 / 419.2 -> 409.3, cosine 119.0 -> 113.0 / 518.8 -> 517.3.
    Slower elsewhere: window 12 (144 tokens, the second block of 128 nearly empty)
    V1 94.3 -> 120.6, cosine 131.0 -> 163.0; window 24 (576 tokens) 273.0 -> 409.1 (20 B
    of spills); 8 warps, 128x64 or 64x256 tiles (the whole window one key block) on window
    16: 91.9 to 224.1 us for V1. The backward keeps 64x64 (64x128 with 4 or 8 warps: 346.9
    and 404.8 against 309.1 us), and so does the forward with attention dropout (sm_90
    build, window 16: 64x128 spills 0.7 to 1.2 KB per thread, 64x64 nothing).
    The loop copy for windows of one region (``_one_region_loop``, where the mask is read
    from region ids) for V1 only: without it, same measurement, V1 87.2 -> 88.2 us (no_grad
    84.2 -> 85.5), cosine 125.1 -> 119.9 (no_grad 108.7 -> 108.8; the copy of its
    255-register loop costs more than the mask it saves); cosine f+b, 3 alternated rounds:
    502.1 -> 500.1 us."""
    return n % 128 == 0 and n // 128 <= 4 and block_d <= 32 and dtype != torch.float32


def _flat_loop(n: int, block: int, block_d: int) -> bool:
    """Whether the forward (and the dkdv kernel, ``backward_config``) of windows of n tokens
    in blocks of ``block`` runs one loop over (window, block) steps (``LaunchConfig.flat_loop``):
    where a window has few blocks, so that waiting for each window's first ones weighs more
    than loading the q tile (the dkdv kernel: k and v) at every step. H200, bf16, D = 32, timm's
    shift mask, forward kernels alone with the statistics saved, nested -> flat (2026-11-24),
    us: window 12 (3 key blocks) V1 104.0 -> 95.4, cosine 140.6 -> 138.9; window 16 (4) V1
    104.7 -> 97.3, cosine 133.4 -> 126.2; window 24 (9) V1 273.6 -> 298.2, cosine 358.4 ->
    379.4. Without statistics: 100.0 -> 91.5, 129.4 -> 113.9; 103.4 -> 94.3, 122.8 -> 117.4;
    272.3 -> 291.2, 328.9 -> 356.5.
    One key block (N <= 128): the two loops are the same. Measured for head_dim 32 only; wider
    heads keep the nested loops (head_dim 256, sm_90 build: the flat dkdv kernel spills 4 KB
    of registers per thread, the nested one 0.4 KB)."""
    return -(-n // block) <= 4 and block_d <= 32


def _one_region_loop(n: int, block: int) -> bool:
    """Whether the kernels that stream key blocks of n tokens take a second copy of their
    loop, without the mask, for the windows of one region (``LaunchConfig.one_region_loop``),
    where they read the mask's region ids (where the launcher folds the mask into their
    bias copy, ``bias_mask.folds_mask``, they are built without a mask and the copy is not
    built), and where the last key block is whole. H200, bf16, D = 32, timm's shift mask (9 of 16
    windows of one region), old and new alternated (bench_op.py --impls ours, 2026-11-24),
    forward us: window 16 V1 109.9 -> 106.8, cosine 131.7 -> 126.2; window 24 292.3 -> 281.0,
    352.8 -> 334.1; but window 12 (144 tokens, the last of three key blocks partial) 104.1 ->
    113.5 and 124.7 -> 141.6: ncu counts 11% fewer instructions there but more stall cycles
    per instruction on shared memory and loads, which the mask's arithmetic used to cover;
    its loop is too short (two whole blocks and a partial one) to hide them otherwise."""
    return n % block == 0


def backward_config(n: int, head_dim: int, dtype: torch.dtype, cosine: bool,
                    arch: Optional[Arch] = None) -> Optional[LaunchConfig]:
    """The fused one-tile backward runs where a whole window fits one tile (and that tile fits
    ``arch``'s shared memory: else the multi-block kernels run). ``arch`` as ``forward_config``'s."""
    n, head_dim = int(n), int(head_dim)
    found = OVERRIDES.get(("bwd", n, head_dim, dtype, cosine))
    if found is not None:
        return found
    return _fitted_backward(n, head_dim, dtype, cosine, arch)


@_cached
def _fitted_backward(n: int, head_dim: int, dtype: torch.dtype, cosine: bool,
                     arch: Optional[Arch]) -> Optional[LaunchConfig]:
    tuned = _default_backward_config(n, head_dim, dtype, cosine)
    if tuned.single_tile(n):
        fitted = budget.window_fit("fused", tuned, n, dtype.itemsize, 0, arch)
        if fitted is not None or tile_side(n) // 2 < budget.MIN_BLOCK:
            return fitted
        tuned = _default_backward_config(n, head_dim, dtype, cosine, True)
    # the dkdv and dq kernels share the tiles: fitted to the larger of the two
    fitted = budget.window_fit("dkdv", tuned, n, dtype.itemsize, 4, arch)
    return fitted and budget.window_fit("dq", fitted, n, dtype.itemsize, 4, arch)


@_cached
def _default_backward_config(n: int, head_dim: int, dtype: torch.dtype, cosine: bool,
                             streamed: bool = False) -> LaunchConfig:
    """streamed: the multi-block kernels' configuration even where a window is one tile, in
    blocks of half its tile (where that tile does not fit the device, ``backward_config``)."""
    block_d = tile_side(head_dim)
    if streamed:
        return LaunchConfig(tile_side(n) // 2, tile_side(n) // 2, block_d, 4, 1, 16, dq_atomic=True,
                            dbias_slots=1 if cosine else 0)
    if n <= 64 and block_d <= 64:
        block = tile_side(n)
        if dtype == torch.float32 and block > 16:
            # float32 multiplies in exact fp32 on the CUDA cores (no tensor cores): with 4 warps
            # the sm_90 build spills 1.4 to 21 KB of registers per thread (tests/arch_build.py,
            # e.g. cosine N=64, D=32: 9512 B), with 8 warps 4 to 11x less (880 B). Chosen from
            # that report; not yet timed on a GPU.
            return LaunchConfig(block, block, block_d, 8, 3, 8)
        return LaunchConfig(block, block, block_d, 4, 3, 8)  # H200, bf16: 1.5x to 2.6x over 8 warps, 1 stage
    block = _streamed_block(n, 64 if block_d <= 64 else 32)
    # the same sweep (D = 32): 3 stages beat 2 by 1.05x to 1.1x on the multi-block backward
    stages = 3 if block_d <= 32 else 2 if block_d <= 64 else 1
    # dQ by atomic adds: H200, bf16, D = 32, kernels alone (2026-11-23), backward us. V1, atomic / dq
    # kernel, both capped: window 12 281 / 402, 16 354 / 479, 24 1030 / 1366; the bias
    # gradient's atomic slot on top: 311, 378, 1049 (slower: the dQ adds already load L2).
    # Cosine, whose dkdv kernel also sums the scale gradient: atomic dQ and one atomic bias
    # slot, uncapped, 401 / 510 / 1433 against the dq and dbias kernels' 471 / 570 / 1674
    # (capped; uncapped 542 / 631 / 1802); capped, the atomic dkdv spills (458 / 565 / 1594).
    # The one-region loop copy (``_one_region_loop``) in the dkdv kernel, same runs, backward us
    # (forward + backward less forward): V1 window 16 333 -> 316, 24 910 -> 860, 12 268 -> 271;
    # cosine 453 -> 462, 1217 -> 1219, 401 -> 389 (its dkdv kernel, at 255 registers, spills more
    # with two loops: 40 -> 96 B of stack on window 16, sm_90 build): V1 only.
    # The dkdv kernel's flat loop (``_flat_loop``), programs of several windows: same runs
    # (2026-11-24), backward us, one window
    # per program -> flat: V1 window 12 264.7 -> 251.7, 16 314.3 -> 308.4, 24 861.6 -> 890.0;
    # cosine 384.8 -> 339.9, 454.0 -> 416.8, 1206.4 -> 1387.7. 8, 16 or 32 programs per SM
    # within 0.5% of each other where the loop is flat.
    return LaunchConfig(block, block, block_d, 4, stages, 16, None if cosine else _streamed_maxnreg(block_d, dtype),
                        dq_atomic=True, dbias_slots=1 if cosine else 0,
                        one_region_loop=not cosine and _one_region_loop(n, block),
                        flat_loop=_flat_loop(n, block, block_d))


def dbias_config(n: int, head_dim: int, dtype: torch.dtype, cosine: bool,
                 arch: Optional[Arch] = None) -> Optional[LaunchConfig]:
    """The tiles of the multi-block backward's dbias kernel, which loops over the windows
    sharing a (head, mask window) and recomputes each one's (query block, key block) tile
    of dZ. A configuration of its own, since it keeps no per-window accumulator and larger
    tiles would fit; but they measured slower: H200, bf16, D = 32, whole V1 backward (2026-11-23),
    window 12 / 16 / 24: 64x64 and 4 warps (the backward's tiles) 278 / 340 / 970 us, 64x128
    or 128x64 with 8 warps 318-323 / 382-384 / 1113-1117, with 4 warps uncapped (spilling)
    343-367 / 390-419 / 1196-1224; 2, 8 or 16 programs per SM instead of 4 within -2% to +6%.

    Where key blocks of 32 pad fewer columns than blocks of 64 (N mod 64 in 1..32: window
    12's 144 tokens pad to 160 rather than 192), 64x32 tiles, uncapped (96 registers), 8
    programs per SM. H200, bf16, D = 32, V1 backward (2026-11-24): window 12 250.6 -> 241.7 us
    (f+b, 3 alternated rounds: 351.8 -> 343.2); on window 16, whose blocks of 64 pad nothing,
    308.1 -> 328.3."""
    n, head_dim = int(n), int(head_dim)
    found = OVERRIDES.get(("dbias", n, head_dim, dtype, cosine))
    if found is not None:
        return found
    tiles = backward_config(n, head_dim, dtype, cosine, arch)
    if tiles is None:
        return None
    tiles = replace(tiles, programs_per_sm=4)
    if tiles.block_n == 64 and 0 < n % 64 <= 32 and not tiles.single_tile(n):
        tiles = replace(tiles, block_n=32, maxnreg=None, programs_per_sm=8)
    return budget.window_fit("dbias", tiles, n, dtype.itemsize, 4, arch)


def with_changes(config: LaunchConfig, **changes) -> LaunchConfig:
    return replace(config, **changes)


def fits(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool, arch: Optional[Arch]) -> bool:
    """Whether both passes have a configuration that fits ``arch``, the multi-block backward's
    dbias kernel included where it runs (else PyTorch computes)."""
    backward = backward_config(n, head_dim, dtype, cosine, arch)
    return (forward_config(n, head_dim, dtype, cosine, dropout, arch=arch) is not None and backward is not None
            and (backward.single_tile(n) or dbias_config(n, head_dim, dtype, cosine, arch) is not None))


def target_programs(arch: Arch, per_sm: int) -> int:
    """How many programs keep the device busy (a handful under the interpreter)."""
    return 4 if INTERPRET or arch.backend == "interpreter" else per_sm * arch.sm_count


#: The fewest windows one program takes (where there are that many): a program reads its
#: bias+mask tile, and the one-tile backward writes its partial bias gradient, once for all
#: its windows. H200, bf16, D = 32, (256, 12, 49, 32) (swin_tiny's stage 3 at batch 64):
#: 3 windows per program (8 programs per SM) took 15.7 us forward and 43.9 us backward,
#: 6 windows 13.1 and 39.5 us (cosine: 23.9 -> 21.3 and 77.2 -> 66.2 us); the shapes that
#: already had 11 windows per program were within 5% of their best either way.
MIN_WINDOWS_PER_PROGRAM = 6


def split_windows(windows: int, parallel: int, target: int, min_windows: Optional[int] = None) -> Tuple[int, int]:
    """Split ``windows`` into chunks so that ``parallel * chunks`` is about ``target``,
    with at least ``min_windows`` (the call's MIN_WINDOWS_PER_PROGRAM, this module's where
    None) windows per chunk where there are that many.

    Integer arithmetic only, so that a symbolic window count traces under torch.compile.
    Returns (chunks, windows_per_chunk).
    """
    fewest = MIN_WINDOWS_PER_PROGRAM if min_windows is None else min_windows
    chunks = min(max(1, cdiv(target, max(parallel, 1))), max(windows, 1))
    per_chunk = max(cdiv(windows, chunks), min(fewest, windows), 1)
    return max(cdiv(windows, per_chunk), 1), per_chunk
