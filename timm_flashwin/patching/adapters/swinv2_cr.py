"""SwinV2-CR: ``timm.models.swin_transformer_v2_cr.WindowMultiHeadAttention``.

Cosine attention with logit_scale of shape (H,); the bias is timm's
``_relative_positional_encodings()``: meta_mlp on the log-spaced offsets of the window's
token pairs, dense (H, N, N). Where the kernels take the tensors and meta_mlp is timm's own
(``fusable_meta_mlp``), it is computed by ``position_mlp_table`` in one kernel (and one
backward), written heads-first, the (H, N, N) bias itself (under torch.compile through its
registered operators); elsewhere (CPU, float64) by timm's method. meta_mlp has dropout
(0.125) that is active in training mode: both draw its mask from the RNG exactly as timm's
forward does (``meta_mlp_dropout_mask``; under torch.compile, inductor draws its own random
numbers for either, unless ``torch._inductor.config.fallback_random``).
"""
import math
from typing import Dict, Type

import torch
from torch import nn

from ...ops.dispatch import uses_kernels
from ...ops.position_mlp import fusable_meta_mlp, meta_mlp_dropout_mask, position_mlp_table
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
        def compute() -> torch.Tensor:
            mlp, coords = module.meta_mlp, module.relative_coordinates_log
            if not (uses_kernels(coords) and fusable_meta_mlp(mlp)):
                return module._relative_positional_encodings()
            n = coords.shape[0]
            mask = meta_mlp_dropout_mask(mlp, coords)
            table = position_mlp_table(coords, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias,
                                       dropout_mask=mask, dropout_p=mlp.drop1.p, heads_first=True)
            side = math.isqrt(n)
            return table.view(module.num_heads, side, side)

        sources = (module.relative_coordinates_log, *module.meta_mlp.parameters())
        return inference_cache(module, sources, compute)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(logit_scale=module.logit_scale)
