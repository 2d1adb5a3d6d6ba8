"""The seed of one call's attention dropout, drawn the same way by both operators (window and
local attention): the kernels draw their random numbers from it and the element's index, and
the backward regenerates the mask from it instead of storing one."""
from __future__ import annotations

import torch


def draw_dropout_seed(device: torch.device) -> torch.Tensor:
    """A one-element int64 tensor drawn from torch's default generator of ``device``, so that
    ``torch.manual_seed`` reproduces a run (and activation checkpointing, which restores the
    RNG state, redraws it)."""
    return torch.randint(0, 2 ** 62, (1,), device=device, dtype=torch.int64)
