"""Twins-SVT: ``timm.models.twins.LocallyGroupedAttn``, its locally-grouped attention.

S = scale * Q K^T (scale = head_dim^-0.5, SDPA's default in timm's fused path); no bias, no
mask; attention dropout attn_drop.p in training mode. The module gets the stage's tokens
(B, H*W, C) and its map size, pads the map with zeros to whole ws x ws windows (the padded
tokens' qkv is the qkv bias; they take part in the attention as keys, as timm's do),
attends within each window and crops.

Here the qkv projection of the padded map is handed to the op with the map's
``WindowGrid`` (no shift): the kernels read each window's rows where they lie and write the
output there, without timm's partition and merge copies (``window_attention(..., grid=)``;
where the kernels cannot, the op partitions and merges). The Twins models' other attention,
GlobalSubSampleAttn, attends from every token to a subsampled map: not window attention.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.window_grid import WindowGrid
from .base import UnbiasedAdapter


@functools.lru_cache(maxsize=64)
def _grid_of(height: int, width: int, ws: int) -> WindowGrid:
    return WindowGrid(-(-height // ws) * ws, -(-width // ws) * ws, (ws, ws))


def _padded_grid(height: int, width: int, ws: int) -> WindowGrid:
    """The grid of a (height, width) map padded at the bottom and right to whole ws x ws
    windows, as timm pads it; in eager mode one object per size, made once (host time).
    dynamo traces through an lru_cache, with a warning: it gets the function itself."""
    return (_grid_of.__wrapped__ if torch.compiler.is_compiling() else _grid_of)(height, width, ws)


class TwinsAdapter(UnbiasedAdapter):
    family = "twins"
    forward_arg = "size"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "num_heads", "ws", "scale")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.twins import LocallyGroupedAttn
        return LocallyGroupedAttn

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        return (module.ws, module.ws)

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, W, C) -> qkv (B, Hp*Wp, 3C) of the map padded to whole windows."""
        grid = _padded_grid(x.shape[1], x.shape[2], module.ws)
        pad_b, pad_r = grid.height - x.shape[1], grid.width - x.shape[2]
        if pad_b or pad_r:
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        return module.qkv(x.flatten(1, 2))

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The op's (B, Hp*Wp, C) output cropped to the map of x (B, H, W, C): (B, H*W, C)."""
        batch, height, width, _ = x.shape
        grid = _padded_grid(height, width, module.ws)
        if (grid.height, grid.width) != (height, width):
            out = out.view(batch, grid.height, grid.width, out.shape[-1])[:, :height, :width]
        return out.reshape(batch, height * width, out.shape[-1])

    def forward(self, module: nn.Module, x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
        """Replacement of the module's forward, timm's signature: x (B, H*W, C) with
        size = (H, W) -> (B, H*W, C)."""
        channels = module.qkv.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, H*W, C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        height, width = size
        if height * width != x.shape[1]:
            raise ValueError(f"{type(module).__name__}: size {tuple(size)} is not the map of the {x.shape[1]} "
                             f"tokens of x (shape {tuple(x.shape)})")
        grid = _padded_grid(height, width, module.ws)
        return self._project(module, x.view(x.shape[0], height, width, channels), None, grid)
