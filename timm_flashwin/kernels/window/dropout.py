"""The attention-dropout keep mask, materialized: for tests and debugging only.

The attention kernels never store their dropout mask; they regenerate it from a seed
(``tiles.dropout_factor``). This kernel evaluates the same function over whole windows,
so that a float64 reference can apply exactly the mask the kernels applied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sizes import cdiv
from ..launcher import compiler_options
from .tiles import dropout_factor

_BLOCK = 32


@triton.jit
def dropout_factor_kernel(seed_ptr, out_ptr, dropout_p, N: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (B_ * H, row blocks, column blocks). out[bh, i, j] = keep / (1 - p)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    factor = dropout_factor(tl.load(seed_ptr), bh, rows, cols, dropout_p, N)
    ptrs = out_ptr + (bh * N + rows[:, None]) * N + cols[None, :]
    tl.store(ptrs, factor, mask=(rows[:, None] < N) & (cols[None, :] < N))


def dropout_factors(seed: torch.Tensor, num_windows: int, num_heads: int, n: int, dropout_p: float) -> torch.Tensor:
    """(B_, H, N, N) float32: 1 / (1 - p) where the kernels keep a probability, 0 where
    they drop it, for the one-element int64 ``seed`` the op drew."""
    out = torch.empty((num_windows, num_heads, n, n), dtype=torch.float32, device=seed.device)
    blocks = cdiv(n, _BLOCK)
    dropout_factor_kernel[(num_windows * num_heads, blocks, blocks)](seed, out, dropout_p, N=n, BLOCK=_BLOCK,
                                                                     **compiler_options())
    return out
