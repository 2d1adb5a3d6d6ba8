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
a unit's t tokens (token s * t / q_stride + j of the unit pools into query j): t / q_stride
queries against t keys. The op takes q, k and v of one qkv of t tokens: the pooled queries
go in its first t / q_stride rows, zeros in the others, whose outputs are dropped. Their
output gradients are then zero, so they add nothing to dK and dV (dS = P (dP - delta) with
dP and delta zero) and get a zero dq: the gradients are timm's. The price is a copy of the
unit's q, k and v and the op's work on t query rows instead of t / q_stride, in 3 of a
model's modules (in windows of up to 64 tokens the kernels take a 64-row tile anyway).
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
        tokens = _unit_tokens(module)
        side = math.isqrt(tokens)
        return (side, side) if side * side == tokens else (tokens, 1)

    def num_heads(self, module: nn.Module) -> int:
        return module.heads

    def head_dim(self, module: nn.Module) -> int:
        return module.head_dim

    # -- layouts ----------------------------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B_, t, 3 * dim_out): the mask units' tokens (B * nW windows) or
        the whole sequence (B windows); with q pooling (B_, t, 3, heads, head_dim), the
        pooled queries in the first t / q_stride rows of q (the module docstring)."""
        if module.use_mask_unit_attn:
            batch, n, channels = x.shape
            units = n // _unit_tokens(module)
            x = x.view(batch, -1, units, channels).transpose(1, 2).reshape(batch * units, -1, channels)
        qkv = module.qkv(x)
        if module.q_stride == 1:
            return qkv
        windows, tokens, _ = qkv.shape
        q, k, v = qkv.view(windows, tokens, 3, module.heads, module.head_dim).unbind(2)
        pooled = q.view(windows, module.q_stride, tokens // module.q_stride, module.heads, module.head_dim).amax(1)
        q = torch.cat([pooled, pooled.new_zeros((windows, tokens - pooled.shape[1]) + pooled.shape[2:])], 1)
        return torch.stack([q, k, v], 2)

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The op's (B_, t, dim_out) output in timm's token order, (B, N / q_stride,
        dim_out): with q pooling its first t / q_stride rows, the pooled queries'."""
        batch, n, _ = x.shape
        if module.q_stride > 1:
            out = out[:, :out.shape[1] // module.q_stride]
        if module.use_mask_unit_attn:
            units = n // _unit_tokens(module)
            out = out.view(batch, units, -1, out.shape[-1]).transpose(1, 2)
        return out.reshape(batch, n // module.q_stride, out.shape[-1])

    def forward(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, N, dim) -> (B, N, dim_out)."""
        channels = module.qkv.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, N, C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        n, unit = x.shape[1], _unit_tokens(module)
        if (module.use_mask_unit_attn and n % unit) or n % module.q_stride:
            expected = f"the mask unit's {unit} tokens" if module.use_mask_unit_attn else f"q_stride {module.q_stride}"
            raise ValueError(f"{type(module).__name__}: expected N a multiple of {expected}, got {n} (x of shape "
                             f"{tuple(x.shape)})")
        tokens = unit if module.use_mask_unit_attn else n
        if tokens > MAX_TOKENS:  # more tokens than the kernels take: timm's forward
            return module._flashwin_timm_forward(x)
        return self._project(module, x, None)


def _unit_tokens(module: nn.Module) -> int:
    """A mask unit's tokens, the keys of its window: ``window_size`` is its queries, fewer by
    q_stride where the module pools them."""
    return module.window_size * module.q_stride
