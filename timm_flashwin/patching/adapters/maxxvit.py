"""MaxViT, MaxxViT, CoAtNet: ``timm.models.maxxvit.AttentionCl`` and ``Attention2d``.

S = scale * Q K^T (scale = dim_head^-0.5, SDPA's in timm's fused path) plus the bias of the
module's ``rel_pos`` (``rel_pos.py``: RelPosBias, RelPosBiasTf, RelPosMlp), or of a
``shared_rel_pos`` passed with the call where the module has none; no mask. The windows
come partitioned: a block's windows (``window_partition``) or its strided grid
(``grid_partition``), both (B * nW, wh, ww, C) to ``AttentionCl`` (PartitionAttentionCl,
ParallelPartitionAttention), (B * nW, C, wh, ww) to ``Attention2d``; CoAtNet's
TransformerBlock2d hands ``Attention2d`` its whole (B, C, H, W) map, one window. In eager
mode the PartitionAttentionCl around an ``AttentionCl`` with (3, H, D) qkv channels (the tf
models) has the op read its block or grid windows from the (B, H, W, C) map instead
(``new_grid``: a ``WindowGrid``, ``strided`` for the grid), without timm's partition and
reverse copies.

qkv is read where timm's layers leave it, as a view (``window_attention`` takes a
(B_, N, 3, H, D) one): ``head_first`` puts each head's q, k and v side by side, channels
(H, 3, D); ``Attention2d``'s 1x1 convolution leaves it channels-first, (B, 3*H*D, N) (under
torch.compile it is a matmul of token-major output, ``MaxxVit2dAdapter.flat_qkv``). The
op's (B, N, H*D) output goes to ``Attention2d``'s proj as a (B, C, H, W) view with
channels-last strides (no copy).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Type, Union

import torch
from torch import nn

from ...ops.position_bias import TableBias
from ...ops.window_checks import MAX_TOKENS
from ...ops.window_grid import WindowGrid
from .base import WindowAttentionAdapter
from .rel_pos import rel_pos_bias, rel_pos_tokens, rel_pos_window, unsupported_rel_pos


class MaxxVitAdapter(WindowAttentionAdapter):
    """``AttentionCl``: x (B, ..., C), channels last, its tokens every axis in between."""

    family = "maxxvit"
    forward_arg = "shared_rel_pos"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "scale", "num_heads", "dim_head", "head_first", "rel_pos")
    block_method = "_partition_attn"
    block_required = ("attn", "partition_size", "partition_block")
    block_partition = ("partition_size", "partition_block")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.maxxvit import AttentionCl
        return AttentionCl

    @staticmethod
    def block_type() -> Optional[Type[nn.Module]]:
        from timm.models.maxxvit import PartitionAttentionCl
        return PartitionAttentionCl

    def new_grid(self, block: nn.Module, height: int, width: int, window, block_windows: bool
                 ) -> Optional[WindowGrid]:
        """The (height, width) map's block windows (``window_partition``) or, not
        ``block_windows``, its strided grid windows (``grid_partition``) of a
        PartitionAttentionCl, or None: H or W not a multiple of the partition, a partition
        other than the module's rel_pos window, more tokens than the kernels take, qkv
        channels (H, 3, D) (``head_first``: read as a 5-D view, which the map layout does not
        take)."""
        window, attn = tuple(window), block.attn
        if (attn.head_first or self.window_size(attn) not in (None, window) or window[0] * window[1] > MAX_TOKENS
                or height % window[0] or width % window[1]):
            return None
        return WindowGrid(height, width, window, strided=not block_windows)

    def block_mask(self, block: nn.Module, x: torch.Tensor) -> None:
        return None  # MaxViT's windows have no mask

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        return rel_pos_window(module.rel_pos) if module.rel_pos is not None else None

    def head_dim(self, module: nn.Module) -> int:
        return module.dim_head

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is None:
            reason = unsupported_rel_pos(module.rel_pos)
        return reason

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor, None]:
        return rel_pos_bias(module, module.rel_pos) if module.rel_pos is not None else None

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))

    # -- layouts ----------------------------------------------------------------------
    def tokens(self, module: nn.Module, x: torch.Tensor) -> int:
        """N of the input x (B, ..., C); a ValueError for any other input."""
        channels = module.qkv.in_features
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[-1] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, ..., C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        return math.prod(x.shape[1:-1])

    def flat_qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The qkv projection as (B, N, 3*H*D), whatever its strides."""
        return module.qkv(x).reshape(x.shape[0], -1, module.qkv.out_features)

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        qkv = self.flat_qkv(module, x)
        if module.head_first:  # channels (H, 3, D): as a (B, N, 3, H, D) view
            return qkv.unflatten(-1, (module.num_heads, 3, module.dim_head)).transpose(2, 3)
        return qkv

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.reshape(*x.shape[:-1], out.shape[-1])

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Replacement of the module's forward, timm's signature: the input's shape -> the
        same with proj's channels."""
        n = self.tokens(module, x)
        if module.rel_pos is not None and n != rel_pos_tokens(module.rel_pos):
            window = rel_pos_window(module.rel_pos)
            raise ValueError(f"{type(module).__name__}: expected {rel_pos_tokens(module.rel_pos)} tokens per window "
                             f"(its rel_pos is for {window[0]}x{window[1]}), got {n} (x of shape {tuple(x.shape)})")
        shared = shared_rel_pos if module.rel_pos is None else None
        heads = module.num_heads
        if n > MAX_TOKENS or (shared is not None and tuple(shared.shape[-3:]) != (heads, n, n)):
            # more tokens than the kernels take, or a bias the op does not: timm's forward
            return module._flashwin_timm_forward(x, shared_rel_pos)
        return self._project(module, x, None, bias=shared)


class MaxxVit2dAdapter(MaxxVitAdapter):
    """``Attention2d``: x (B, C, H, W), qkv and proj 1x1 convolutions."""

    family = "maxxvit_2d"
    model_family = "maxxvit"

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.maxxvit import Attention2d
        return Attention2d

    @staticmethod
    def block_type() -> Optional[Type[nn.Module]]:
        return None  # its blocks (PartitionAttention2d, TransformerBlock2d) keep timm's partition

    def tokens(self, module: nn.Module, x: torch.Tensor) -> int:
        channels = module.qkv.in_channels
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, C, H, W) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        return x.shape[2] * x.shape[3]

    def flat_qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """(B, 3*H*D, N) transposed (tokens the innermost axis) in eager mode. Under
        torch.compile the 1x1 convolution is a matmul of the map's (B, N, C) view whose output
        is token-major, the op's layout: the kernels are launched with the strides the graph was
        traced with, so inductor wrote the convolution's channels-first output and the op read
        it transposed, a transpose kernel per module (CoAtNet-0 inference, batch 128, H100:
        6 x 163 us, the compiled patched model 0.96x timm's)."""
        conv = module.qkv
        if torch.compiler.is_compiling() and _plain_pointwise(conv):
            return nn.functional.linear(x.flatten(2).transpose(1, 2), conv.weight.flatten(1), conv.bias)
        return conv(x).flatten(2).transpose(1, 2)

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        return out.view(batch, height, width, out.shape[-1]).permute(0, 3, 1, 2)


def _plain_pointwise(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain nn.Conv2d of 1x1 kernels with no hooks (its matmul computes
    what calling it does; hooks, as FSDP's or a quantizer's, need the call)."""
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
    return (type(conv) is nn.Conv2d and tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1)
            and conv.padding in ((0, 0), "valid", "same") and tuple(conv.dilation) == (1, 1) and conv.groups == 1
            and not (conv._forward_hooks or conv._forward_pre_hooks or _global_forward_hooks
                     or _global_forward_pre_hooks))
