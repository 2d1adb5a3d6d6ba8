"""Hiera: ``timm.models.hiera.MaskUnitAttention``.

S = scale * Q K^T (scale = head_dim^-0.5, SDPA's default in timm's fused path); no bias, no
mask, no dropout. The module gets x (B, N, C) with the tokens unrolled (timm's ``Unroll``)
so that mask unit w's token t is row t * nW + w, and attends

- with ``use_mask_unit_attn``, within each of the nW = N / window_size mask units (timm
  hands SDPA 5-D tensors (B, H, nW, t, D), which PyTorch's fused kernels refuse): here x is
  put in unit order (B * nW, t, C) first (a copy of C channels, not of the 3C of qkv: a
  batch's units cannot be one stride of qkv) and the output back in timm's order before
  proj (a copy; proj is per token);
- without it, globally over the N tokens: one window per image, qkv as it lies.

The first block of a pooling stage (``q_stride`` > 1) max-pools q over q_stride groups of
a unit's t tokens (token s * t / q_stride + j of the unit pools into query j): t / q_stride
queries against t keys. Those blocks, and global attention over more tokens than the window
kernels take, go to the local-attention operator (``sliding_window_attention`` with an
unlimited window: global attention, S_q queries against S_k keys), which reads q, k and v
as strided views of the qkv projection, the pooled q as ``amax`` leaves it: no copy of
qkv, and t / q_stride query rows computed, not t.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Type

import torch
from torch import nn

from ...ops.local import sliding_window_attention
from ...ops.window_grid import WindowGrid
from .base import UnbiasedAdapter, WithoutDropout

#: the most tokens of a window (a mask unit, or the whole map) the window operator takes
#: here; more go to the local operator, unbiased and made for long rows (from 1024 to the
#: window operator's limit, ``ops.window_checks.MAX_TOKENS``, either serves; which is faster there is
#: not measured)
WINDOW_OP_TOKENS = 1024


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
        the whole sequence (B windows)."""
        if module.use_mask_unit_attn:
            batch, n, channels = x.shape
            units = n // _unit_tokens(module)
            x = x.view(batch, -1, units, channels).transpose(1, 2).reshape(batch * units, -1, channels)
        return module.qkv(x)

    def _attention(self, module: nn.Module, x: torch.Tensor, bias: None, mask: None, dropout_p: float,
                   grid: Optional[WindowGrid] = None) -> torch.Tensor:
        """x (B, N, C) -> (B_, t / q_stride, dim_out): the window operator where it serves
        (no pooling, windows it takes), else the local one on views of qkv (the module
        docstring)."""
        tokens = _unit_tokens(module) if module.use_mask_unit_attn else x.shape[1]
        if module.q_stride == 1 and tokens <= WINDOW_OP_TOKENS:
            return super()._attention(module, x, bias, mask, dropout_p, grid)
        qkv = self.qkv(module, x)
        windows, heads, head_dim = qkv.shape[0], module.heads, module.head_dim
        q, k, v = qkv.view(windows, tokens, 3, heads, head_dim).unbind(2)  # each (B_, t, heads, head_dim)
        if module.q_stride > 1:
            q = q.view(windows, module.q_stride, tokens // module.q_stride, heads, head_dim).amax(1)
        out = sliding_window_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       scale=float(module.scale))
        return out.transpose(1, 2).reshape(windows, q.shape[1], heads * head_dim)

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention's (B_, t / q_stride, dim_out) output in timm's token order,
        (B, N / q_stride, dim_out)."""
        batch, n, _ = x.shape
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
        return self._project(module, x, None)


def _unit_tokens(module: nn.Module) -> int:
    """A mask unit's tokens, the keys of its window: ``window_size`` is its queries, fewer by
    q_stride where the module pools them."""
    return module.window_size * module.q_stride
