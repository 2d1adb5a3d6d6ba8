"""transformers' SwinV2 attention and its copy: ``Swinv2Attention`` (models/swinv2) and
``Swin2SRAttention`` (models/swin2sr, super-resolution), "self_output" layout (``hf_base``)
in 4.x and 5.x.

S = exp(min(logit_scale, ln 100)) * Q^ K^^T (cosine attention), plus
16 * sigmoid(continuous_position_bias_mlp(relative_coords_table)[relative_position_index])
(``swinv2.cpb_position_bias``, the timm SwinV2 adapter's), plus the layer's shift mask.
transformers up to 5.24 adds that mask twice (-200 where timm has -100): either is 0 after
the softmax in float32 and wider types (exp(-100) < 4e-44), so the op adds it once.
"""
from typing import Dict, Union

import torch
from torch import nn

from ...ops.position_bias import TableBias
from .hf_base import HfAttentionAdapter
from .swinv2 import cpb_position_bias


class HfSwinv2Adapter(HfAttentionAdapter):
    family = "hf_swinv2"
    hf_module = "transformers.models.swinv2.modeling_swinv2"
    hf_class = "Swinv2Attention"
    self_required = HfAttentionAdapter.self_required + (
        "logit_scale", "continuous_position_bias_mlp", "relative_coords_table", "relative_position_index")

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        attention = module.self
        return cpb_position_bias(module, attention.continuous_position_bias_mlp, attention.relative_coords_table,
                                 attention.relative_position_index, attention.num_attention_heads)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(logit_scale=module.self.logit_scale)


class HfSwin2SRAdapter(HfSwinv2Adapter):
    family = "hf_swin2sr"
    hf_module = "transformers.models.swin2sr.modeling_swin2sr"
    hf_class = "Swin2SRAttention"
