"""DaViT: ``timm.models.davit.WindowAttention``, the spatial blocks' attention.

S = scale * Q K^T (scale = head_dim^-0.5, SDPA's default in timm's fused path); no bias, no
mask, no dropout. SpatialBlock pads its normalized map to whole windows with zeros (the
padded tokens take part in the attention as keys, as timm's do), partitions it and hands
the module (B * nW, wh * ww, C), qkv in timm's (3, H, D) channels: the Swin layout. The
channel blocks' ChannelAttention attends over channels, not windows: not this family.
"""
from __future__ import annotations

from typing import Type

from torch import nn

from .base import UnbiasedAdapter, WithoutDropout


class DaVitAdapter(WithoutDropout, UnbiasedAdapter):
    family = "davit"
    forward_arg = None
    required = ("qkv", "proj", "num_heads", "window_size", "scale")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.davit import WindowAttention
        return WindowAttention
