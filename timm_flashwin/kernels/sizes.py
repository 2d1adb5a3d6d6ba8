"""Launch sizes that every kernel family's host side computes the same way: tile sides and
ceiling divisions, in plain integer arithmetic."""
from __future__ import annotations

#: the smallest tile side the kernels take (tl.dot's)
MIN_BLOCK = 16


def tile_side(x: int) -> int:
    """The smallest power of two that holds ``x`` (rows, tokens or a head's dims), at least
    ``MIN_BLOCK``."""
    return max(MIN_BLOCK, 1 << (int(x) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints. Not ``triton.cdiv``: from Triton 3.8 it (and
    ``triton.next_power_of_2``) is a ``ConstexprFunction`` whose every call on the host costs
    about 10 us on a CPU of CI's kind (the local operators' 10 such calls per forward +
    backward were about 100 us of host time). Plain arithmetic also traces with symbolic
    sizes (torch.compile's dynamic shapes)."""
    return (a + b - 1) // b
