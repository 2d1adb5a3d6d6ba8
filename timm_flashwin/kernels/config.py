"""Tile sizes and work split for the kernels.

Everything here depends only on (N, head_dim, dtype, pass) and the device: never on the
number of windows, so a new batch size never recompiles a kernel.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

#: Set before triton is imported: the kernels then run on CPU tensors through numpy.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_TOKENS = 1024
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Tiles:
    """Block sizes of one kernel launch. block_n >= N means one key block per window."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int

    def single_tile(self, n: int) -> bool:
        return self.block_m >= n and self.block_n >= n


def _pow2(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def forward_tiles(n: int, head_dim: int) -> Tiles:
    block_d = _pow2(head_dim)
    if n <= 64:
        block = _pow2(n)
        return Tiles(block, block, block_d, 4, 2)
    if n <= 128 and block_d <= 64:
        return Tiles(64, 128, block_d, 4, 2)
    block = 32 if block_d >= 256 else 64
    return Tiles(block, block, block_d, 4 if block_d <= 64 else 8, 2)


def backward_tiles(n: int, head_dim: int) -> Tiles:
    """The fused one-tile backward runs where a whole window fits one tile."""
    block_d = _pow2(head_dim)
    if n <= 64 and block_d <= 128:
        block = _pow2(n)
        return Tiles(block, block, block_d, 4, 2)
    if n <= 128 and block_d <= 32:
        return Tiles(128, 128, block_d, 8, 1)
    block = 32 if block_d >= 128 else 64
    return Tiles(block, block, block_d, 4, 2)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device, per_sm: int) -> int:
    """How many programs keep the device busy (a handful under the interpreter)."""
    if device.type != "cuda":
        return 4
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _cdiv(a, b):
    return (a + b - 1) // b


def split_windows(windows: int, parallel: int, target: int) -> tuple[int, int]:
    """Split ``windows`` into chunks so that ``parallel * chunks`` is about ``target``.

    Integer arithmetic only, so that a symbolic window count traces under torch.compile.
    Returns (chunks, windows_per_chunk).
    """
    chunks = min(max(1, _cdiv(target, max(parallel, 1))), max(windows, 1))
    per_chunk = max(_cdiv(windows, chunks), 1)
    return max(_cdiv(windows, per_chunk), 1), per_chunk
