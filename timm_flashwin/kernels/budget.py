"""Shared-memory budgets: the launch configurations fitted to what one program may take.

The tuned configurations (``config``, ``local.launch``) were chosen on H100/H200, which
give a program 227 KB of shared memory. An A100 gives 163 KB; an RTX 3090/4090, A10, L4
and RTX 5090 99 KB; a T4 64 KB. Triton allocates shared memory for the tiles a product
takes (tl.dot's operands pass through it) and, per extra pipeline stage, for the tiles the
loop loads ahead; a program that asks for more than the device has fails at launch.

``window_fit`` and ``local_fit`` take a tuned configuration down until the estimate fits:
fewer pipeline stages first (the tiles stay, and with them every decision that depends on
whether a window is one tile), then, for the kernels that stream key blocks, smaller key and
query blocks. Hopper and Blackwell datacenter GPUs (sm_90, sm_100) keep the tuned
configurations as they are: their builds fit with room to spare (192 KB at most of their
227) and their products (wgmma, tcgen05) lay tiles out otherwise.

The estimates are fitted to compile-only builds for sm_86 (triton 3.8, mma.sync, 2026-11-28):
one stage takes the product tiles plus a score tile (two in the streaming backward, for
dropout's, and the gradients' conversion where it is larger); each further stage adds the
bias and mask tiles a loop step loads (x1.25, x1.1 with float32 inputs) and, with float32
inputs (products on the CUDA cores, operands staged apart), 1.3x the product tiles the step
loads; 16-bit products reuse their staging buffers (1/8 of them and 1 KB a stage). The plans
rely on the estimate, so it must not fall under the compiler's figure. tests/plan_fits.py
builds every configuration the plans choose for the served models' shapes and the build
cases (885 builds for sm_80 to sm_120, 2026-11-28: every one within its budget, the estimate
1.0x to 7.1x the compiler's figure on sm_80/86/89 and sm_120, after the terms its first full
run found under were added); CI builds the 12 per family nearest their budget.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from .arch import Arch
from .sizes import MIN_BLOCK


def keeps_tuned(arch: Optional[Arch]) -> bool:
    """Whether ``arch`` runs the tuned configurations unchanged: Hopper, Blackwell (sm_100),
    the interpreter (no shared memory), and no architecture named (tests of the defaults)."""
    return arch is None or arch.backend == "interpreter" or arch.capability in (90, 100, 103)


def _stage_bytes(elem: int, loop_products: int, loop_tiles: int, product_share: float = 0.125) -> int:
    """What one more pipeline stage adds (the module's docstring has the fit):
    ``product_share`` of the product tiles a step loads with 16-bit inputs."""
    if elem == 4:
        return math.ceil(1.3 * loop_products + 1.1 * loop_tiles)
    return math.ceil(product_share * loop_products + 1.25 * loop_tiles) + 1024


def window_shared_bytes(kernel: str, block_m: int, block_n: int, block_d: int, stages: int, elem: int,
                        streamed: bool, mask_bytes: int) -> int:
    """Estimated shared memory of one window-attention kernel ("fwd", "fused", "dkdv", "dq",
    "dbias") with these tiles, ``elem`` bytes per input element, ``streamed`` whether it
    streams key blocks (it then loads a bias tile per step: a float16 copy with 16-bit inputs)
    and ``mask_bytes`` per mask element it may read (0: none, folded or region ids)."""
    row, col = block_m * block_d * elem, block_n * block_d * elem  # a query / key tile
    scores = block_m * block_n * 4
    bias_mask = block_m * block_n * ((2 if elem == 2 else 4) + mask_bytes) if streamed else 0
    # the backward's configurations are shared by calls with and without attention dropout,
    # whose keep mask takes a score tile more in the kernels streaming key blocks (sm_86
    # build, bf16 dkdv kernel, 64 x 64 tiles, 3 stages: 92 KB without, 104 KB with dropout)
    if kernel == "fwd":
        one = max(row + 2 * col, scores)
        products, tiles = 2 * col + (0 if streamed else row), bias_mask
    elif kernel == "fused":
        # the scores, or the fp32 gradient tiles' conversion where they are larger (head_dim 128:
        # 96 KB, sm_86 build); dropout's mask fits in that room
        one = 5 * col + block_n * max(block_n, block_d) * 4
        products, tiles = 4 * col, 0
    elif kernel == "dkdv":
        one = 2 * (row + col) + 2 * scores + block_n * block_d * 4
        products, tiles = 2 * row, bias_mask
    elif kernel == "dq":  # and the dQ accumulator's conversion (fp32, head_dim 256: 80 KB on sm_120)
        one = 2 * (row + col) + 2 * scores + block_m * block_d * 4
        products, tiles = 2 * col, bias_mask
    elif kernel == "dbias":
        one = 2 * (row + col) + 2 * scores
        products, tiles = 2 * (row + col), bias_mask
    else:
        raise ValueError(f"window_shared_bytes: unknown kernel {kernel!r}")
    return one + max(stages - 1, 0) * _stage_bytes(elem, products, tiles)


def window_fit(kernel: str, tiles, n: int, elem: int, mask_bytes: int, arch: Optional[Arch]):
    """``tiles`` (a ``config.LaunchConfig``) fitted to ``arch``'s shared memory: fewer stages,
    then (kernels streaming key blocks only) halved key blocks, then query blocks. None where
    nothing fits (a window of one tile whose tile alone is too large: the op computes it with
    PyTorch there, ``config.fits``)."""
    if keeps_tuned(arch):
        return tiles
    streamed = n > tiles.block_n or kernel in ("dkdv", "dq", "dbias")

    def need(t) -> int:
        return window_shared_bytes(kernel, t.block_m, t.block_n, t.block_d, t.num_stages, elem, streamed, mask_bytes)
    while need(tiles) > arch.shared_memory:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif streamed and tiles.block_n > MIN_BLOCK and tiles.block_n >= tiles.block_m:
            tiles = replace(tiles, block_n=tiles.block_n // 2, maxnreg=None, flat_loop=False, one_region_loop=False)
        elif streamed and tiles.block_m > MIN_BLOCK:
            tiles = replace(tiles, block_m=tiles.block_m // 2, maxnreg=None)
        else:
            return None
    return tiles


def local_shared_bytes(kernel: str, block_m: int, block_n: int, block_d: int, stages: int, elem: int) -> int:
    """Estimated shared memory of a local-attention kernel ("fwd", "dq", "dkdv"): no bias or
    mask tiles (the pattern is arithmetic on positions), but their 16-bit product tiles do
    take staging buffers per stage (0.77x at most on the sm_86 builds, fitted as 0.8x)."""
    # float32 products are three TF32 ones (``local.tiles.product``): each operand is split into
    # a high and a low part, staged apart (sm_86 build of the dq kernel at head_dim 128, 64 x 32
    # tiles, 8 warps: 144 KB where 16-bit inputs take 48 KB)
    split = 1.5 if elem == 4 else 1
    row, col = int(split * block_m * block_d * elem), int(split * block_n * block_d * elem)
    scores = block_m * block_n * 4
    if kernel == "fwd":
        one, products = max(row + 2 * col, scores), 2 * col
    elif kernel == "dq":
        one, products = 2 * (row + col) + scores // 4, 2 * col
    elif kernel == "dkdv":  # the dK and dV accumulators' conversion (16-bit), dropout's tile (fp32)
        one, products = 2 * (row + col) + (block_n * block_d * 4 if elem == 2 else 2 * scores), 2 * row
    else:
        raise ValueError(f"local_shared_bytes: unknown kernel {kernel!r}")
    return one + max(stages - 1, 0) * _stage_bytes(elem, products, 0, product_share=0.8)


def local_fit(kernel: str, tiles, block_d: int, elem: int, arch: Optional[Arch]):
    """A local-attention ``tiles`` (``local.launch.Plan``) fitted to ``arch``: fewer stages,
    then halved blocks (the wider first), at most 4 warps once a block is 64 rows or fewer
    (every tile size computes the same: the pattern is per position). None where 16 x 16
    tiles do not fit either."""
    if keeps_tuned(arch):
        return tiles

    def need(t) -> int:
        return local_shared_bytes(kernel, t.block_m, t.block_n, block_d, t.num_stages, elem)
    while need(tiles) > arch.shared_memory:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif max(tiles.block_m, tiles.block_n) > MIN_BLOCK:
            wider = "block_m" if tiles.block_m >= tiles.block_n else "block_n"
            tiles = replace(tiles, **{wider: getattr(tiles, wider) // 2})
            if max(tiles.block_m, tiles.block_n) <= 64:
                tiles = replace(tiles, num_warps=min(tiles.num_warps, 4))
        else:
            return None  # float32 at head_dim 256 on a 64 KB GPU (sm_75): PyTorch computes there
    return tiles
