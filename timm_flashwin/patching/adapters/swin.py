"""Swin Transformer V1 (and swin_s3): ``timm.models.swin_transformer.WindowAttention``.

S = scale * Q K^T; the bias is what timm's ``_get_rel_pos_bias()`` computes, a gather from
relative_position_bias_table ((2Wh-1)(2Ww-1), H) by relative_position_index, handed to
the op as a ``TableBias`` (gathered within its autograd node in eager mode; its backward
sums the table gradient in one kernel).
"""
import math
from typing import Dict, Type, Union

import torch
from torch import nn

from ...ops.position_bias import TableBias
from ...ops.dispatch import exporting
from .base import WindowAttentionAdapter, inference_cache


class SwinAdapter(WindowAttentionAdapter):
    family = "swin"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "scale", "num_heads", "window_size",
                "relative_position_bias_table", "relative_position_index")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.swin_transformer import WindowAttention
        return WindowAttention

    @staticmethod
    def block_type() -> Type[nn.Module]:
        from timm.models.swin_transformer import SwinTransformerBlock
        return SwinTransformerBlock

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        return table_position_bias(module, module.relative_position_bias_table, module.relative_position_index)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))


def table_position_bias(module: nn.Module, table: torch.Tensor, index: torch.Tensor) -> Union[TableBias, torch.Tensor]:
    """V1's bias for ``module``'s call: ``table`` ((2Wh-1)(2Ww-1), H) gathered by ``index``
    (N*N or (N, N) integer rows), as the op takes it (``inference_cache``'s: kept gathered
    in inference)."""
    window_tokens = math.isqrt(index.numel())
    return inference_cache(module, (table, index), lambda: TableBias(
        table, index.view(window_tokens, window_tokens), constant_index=not exporting()))
