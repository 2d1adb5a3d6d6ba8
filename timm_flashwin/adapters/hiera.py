"""Hiera: ``timm.models.hiera.MaskUnitAttention``.

S = scale * Q K^T (scale = head_dim^-0.5, SDPA's default in timm's fused path); no bias, no
mask, no dropout. The module gets x (B, N, C) with the tokens unrolled (timm's ``Unroll``)
so that mask unit w's token t is row t * nW + w, and attends

- with ``use_mask_unit_attn``, within each of the nW = N / window_size mask units (timm
  hands SDPA 5-D tensors (B, H, nW, t, D), which PyTorch's fused kernels refuse): here x is
  put in unit order (B * nW, t, C) first (a copy of C channels, not of the 3C of qkv: a
  batch's units cannot be one stride of qkv) and the output back in timm's order before
  proj (a copy; proj is per token);
- without it, globally over the N tokens: one window per image, qkv as it lies; more tokens
  than the kernels take run timm's forward.

The first block of a pooling stage (``q_stride`` > 1) max-pools q over q_stride groups of
tokens: N / q_stride queries against N keys, which the op, taking q, k and v of one qkv of
N tokens, does not compute: such a module keeps timm's forward, with that reason.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Type

import torch
from torch import nn

from ..kernels.config import MAX_TOKENS
from .base import UnbiasedAdapter, WithoutDropout


class HieraAdapter(WithoutDropout, UnbiasedAdapter):
    family = "hiera"
    forward_arg = None
    required = ("qkv", "proj", "heads", "head_dim", "scale", "q_stride", "window_size", "use_mask_unit_attn",
                "dim_out")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.hiera import MaskUnitAttention
        return MaskUnitAttention

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        """A mask unit's (height, width) where its t tokens are a square (Hiera's 2-D units),
        else (t, 1); None for global attention (the whole map, known at call time)."""
        if not module.use_mask_unit_attn:
            return None
        tokens = module.window_size * module.q_stride
        side = math.isqrt(tokens)
        return (side, side) if side * side == tokens else (tokens, 1)

    def num_heads(self, module: nn.Module) -> int:
        return module.heads

    def head_dim(self, module: nn.Module) -> int:
        return module.head_dim

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is None and module.q_stride > 1:
            return (f"q pooling (q_stride {module.q_stride}): N / {module.q_stride} queries against N keys; the op "
                    "takes as many queries as keys")
        return reason

    # -- layouts ----------------------------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B_, t, 3 * dim_out): the mask units' tokens (B * nW windows) or
        the whole sequence (B windows)."""
        if module.use_mask_unit_attn:
            batch, n, channels = x.shape
            units = n // module.window_size
            x = x.view(batch, -1, units, channels).transpose(1, 2).reshape(batch * units, -1, channels)
        return module.qkv(x)

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The op's (B_, t, dim_out) output in timm's token order, (B, N, dim_out)."""
        batch, n, _ = x.shape
        if module.use_mask_unit_attn:
            units = n // module.window_size
            out = out.view(batch, units, -1, out.shape[-1]).transpose(1, 2)
        return out.reshape(batch, n, out.shape[-1])

    def forward(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, N, dim) -> (B, N, dim_out)."""
        channels = module.qkv.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, N, C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        n = x.shape[1]
        if module.use_mask_unit_attn and n % module.window_size:
            raise ValueError(f"{type(module).__name__}: expected N a multiple of the mask unit's {module.window_size} "
                             f"tokens, got {n} (x of shape {tuple(x.shape)})")
        tokens = module.window_size if module.use_mask_unit_attn else n
        if tokens > MAX_TOKENS:  # more tokens than the kernels take: timm's forward
            return module._flashwin_timm_forward(x)
        return self._project(module, x, None)
