"""SwinV2-CR: ``timm.models.swin_transformer_v2_cr.WindowMultiHeadAttention``.

Cosine attention with logit_scale of shape (H,); the bias is timm's own
``_relative_positional_encodings()`` (meta_mlp on log-spaced relative coordinates, dense
(1, H, N, N)). meta_mlp has dropout (0.125) that is active in training mode: calling
timm's method draws from the RNG exactly as timm's forward does.
"""
from typing import Dict, Type

import torch
from torch import nn

from .base import WindowAttentionAdapter, inference_cache


class SwinV2CRAdapter(WindowAttentionAdapter):
    family = "swinv2_cr"
    block_method = "_shifted_window_attn"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "logit_scale", "meta_mlp", "relative_coordinates_log",
                "num_heads", "window_size", "_relative_positional_encodings")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention
        return WindowMultiHeadAttention

    @staticmethod
    def block_type() -> Type[nn.Module]:
        from timm.models.swin_transformer_v2_cr import SwinTransformerV2CrBlock
        return SwinTransformerV2CrBlock

    def head_dim(self, module: nn.Module) -> int:
        return module.qkv.in_features // module.num_heads

    def position_bias(self, module: nn.Module) -> torch.Tensor:
        sources = (module.relative_coordinates_log, *module.meta_mlp.parameters())
        return inference_cache(module, sources, module._relative_positional_encodings)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(logit_scale=module.logit_scale)
