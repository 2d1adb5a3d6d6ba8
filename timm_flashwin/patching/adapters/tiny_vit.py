"""TinyViT: ``timm.models.tiny_vit.Attention``.

S = scale * Q K^T (scale = key_dim^-0.5, SDPA's default in timm's fused path) plus a
LeViT-style bias: ``attention_biases`` (H, offsets), one learned value per head and
(|dy|, |dx|) offset, read through ``attention_bias_idxs`` (N, N). That is a table gathered by
an index, handed to the op as ``TableBias(attention_biases.t(), attention_bias_idxs)``:
the (offsets, H) view of the parameter, no copy, its gradient summed into the table by the
op's kernels. No mask, no dropout.

The module normalizes its input itself (its ``norm`` before ``qkv``), and its qkv channels
are per head (H, 3, D) (``view(B, N, H, -1).split([key_dim, key_dim, val_dim])``): read in
place as the op's (B_, N, 3, H, D) view. TinyVitBlock pads its map to whole windows with
zeros before the module (its padded tokens, normalized, take part in the attention as
timm's do) and hands it (B * nW, N, C); a map no larger than one window comes whole.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type, Union

import torch
from torch import nn

from ...ops.position_bias import TableBias
from ...ops.dispatch import exporting
from .base import WindowAttentionAdapter, WithoutDropout, inference_cache


class TinyVitAdapter(WithoutDropout, WindowAttentionAdapter):
    family = "tiny_vit"
    forward_arg = None
    required = ("norm", "qkv", "proj", "num_heads", "key_dim", "val_dim", "scale", "resolution",
                "attention_biases", "attention_bias_idxs")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.tiny_vit import Attention
        return Attention

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        return tuple(module.resolution)

    def head_dim(self, module: nn.Module) -> int:
        return module.key_dim

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is None and module.val_dim != module.key_dim:
            return (f"val_dim {module.val_dim} is not key_dim {module.key_dim} (attn_ratio {module.attn_ratio}): "
                    "the op takes q, k and v of one head_dim")
        return reason

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """(B_, N, C) -> the (B_, N, 3, H, D) view of qkv(norm(x)), whose channels are (H, 3, D)."""
        qkv = module.qkv(module.norm(x))
        return qkv.unflatten(-1, (module.num_heads, 3, module.key_dim)).transpose(2, 3)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        table, index = module.attention_biases, module.attention_bias_idxs
        return inference_cache(module, (table, index),
                               lambda: TableBias(table.t(), index, constant_index=not exporting()))

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))
