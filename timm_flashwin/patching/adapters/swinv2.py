"""SwinV2: ``timm.models.swin_transformer_v2.WindowAttention``.

S = exp(min(logit_scale, ln 100)) * Q^ K^^T (cosine attention); the bias is
16 * sigmoid(cpb_mlp(relative_coords_table)[relative_position_index]), as timm computes it:
timm's cpb_mlp in one kernel (``position_mlp_table``, fp32, where the module is timm's
Linear -> ReLU -> Linear and the kernels run), the gather and the sigmoid within the op
(a ``TableBias`` with sigmoid_scale=16; the sigmoid is elementwise, so its place does not
change the values). The qkv bias is cat(q_bias, k_bias (a zero buffer), v_bias).
"""
from typing import Dict, Type, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.window import uses_kernels
from ...ops.position_bias import TableBias
from ...ops.position_mlp import fusable_cpb_mlp, position_mlp_table
from ...ops.dispatch import exporting
from .base import WindowAttentionAdapter, inference_cache


class SwinV2Adapter(WindowAttentionAdapter):
    family = "swinv2"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "logit_scale", "cpb_mlp", "relative_coords_table",
                "relative_position_index", "q_bias", "v_bias", "num_heads", "window_size")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.swin_transformer_v2 import WindowAttention
        return WindowAttention

    @staticmethod
    def block_type() -> Type[nn.Module]:
        from timm.models.swin_transformer_v2 import SwinTransformerV2Block
        return SwinTransformerV2Block

    def head_dim(self, module: nn.Module) -> int:
        return module.qkv.in_features // module.num_heads

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if module.q_bias is None:
            return module.qkv(x)
        qkv_bias = torch.cat((module.q_bias, module.k_bias, module.v_bias))
        if getattr(module, "qkv_bias_separate", False):
            qkv = module.qkv(x)
            qkv += qkv_bias
            return qkv
        return F.linear(x, weight=module.qkv.weight, bias=qkv_bias)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        return cpb_position_bias(module, module.cpb_mlp, module.relative_coords_table, module.relative_position_index,
                                 module.num_heads)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(logit_scale=module.logit_scale)


def cpb_position_bias(module: nn.Module, mlp: nn.Module, coords: torch.Tensor, index: torch.Tensor,
                      num_heads: int) -> Union[TableBias, torch.Tensor]:
    """SwinV2's bias for ``module``'s call: 16 * sigmoid(mlp(coords)[index]), coords
    (1, 2Wh-1, 2Ww-1, 2), index (N, N), the MLP Linear(2, K) -> ReLU -> Linear(K, H) (in one
    kernel where it is exactly that, ``fusable_cpb_mlp``), as the op takes it
    (``inference_cache``'s: kept in inference)."""
    def compute() -> TableBias:
        if uses_kernels(coords) and fusable_cpb_mlp(mlp):
            table = position_mlp_table(coords.view(-1, 2), mlp[0].weight, mlp[0].bias, mlp[2].weight)
        else:
            table = mlp(coords).view(-1, num_heads)
        return TableBias(table, index, sigmoid_scale=16.0, constant_index=not exporting())

    return inference_cache(module, (coords, index, *mlp.parameters()), compute)
