"""NesT: ``timm.models.nest.Attention``, attention within each image block.

S = scale * Q K^T (scale = head_dim^-0.5, SDPA's default in timm's fused path); no bias, no
mask; attention dropout attn_drop.p in training mode. The module gets x (B, T, N, C): T
image blocks (the windows, blockified by its level) of N tokens each, and timm hands SDPA
5-D tensors (B, H, T, N, D), which PyTorch's fused kernels refuse. Here the qkv projection
(B, T, N, 3C) is the op's (B * T, N, 3C) windows as they lie, the Swin layout: no copy. timm
hands its proj the heads' outputs with channels (D, H), not (H, D): the op's output is
permuted so (a copy of C channels; proj's weight is read by proj alone).
The window is whatever N comes (a level's block, 14x14 at 224): checked at call time; more
tokens than the kernels take run timm's forward.
"""
from __future__ import annotations

from typing import Optional, Tuple, Type

import torch
from torch import nn

from ...ops.window_checks import MAX_TOKENS
from .base import UnbiasedAdapter


class NestAdapter(UnbiasedAdapter):
    family = "nest"
    forward_arg = None
    required = ("qkv", "proj", "proj_drop", "attn_drop", "num_heads", "scale")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.nest import Attention
        return Attention

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        return None  # the level's block, known at call time

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, N, C) -> (B * T, N, 3C)."""
        return module.qkv(x).flatten(0, 1)

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The op's (B * T, N, C) output, channels (H, D), as timm's proj takes it: (B, T, N, C)
        with channels (D, H) (timm permutes its (B, H, T, N, D) output to (B, T, N, D, H))."""
        heads = module.num_heads
        out = out.view(*x.shape[:-1], heads, out.shape[-1] // heads).transpose(-1, -2)
        return out.reshape(*x.shape[:-1], -1)

    def forward(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, T, N, C) -> (B, T, N, C)."""
        channels = module.qkv.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[3] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, T, N, C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[2] > MAX_TOKENS:  # more tokens than the kernels take: timm's forward
            return module._flashwin_timm_forward(x)
        return self._project(module, x, None)
