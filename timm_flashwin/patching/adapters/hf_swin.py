"""transformers' Swin V1 attention and its copies: ``SwinAttention`` (models/swin),
``DonutSwinAttention`` (models/donut, Donut's encoder), ``MaskFormerSwinAttention``
(models/maskformer, MaskFormer's Swin backbone).

S = Q K^T / sqrt(D) plus relative_position_bias_table gathered by relative_position_index
(``swin.table_position_bias``, the timm V1 adapter's), plus the layer's shift mask.
transformers 5.x's SwinAttention is in the "projections" layout (``hf_base``): its math is
that of transformers' eager and SDPA interfaces alike (the bias added to the shift mask
into one float mask), so both are served; another interface the config names (a kernel
registered with transformers) keeps transformers' path. DonutSwin and MaskFormerSwin are
"Copied from" Swin in transformers and share this adapter's code, each under its family
name, in the "self_output" layout only: theirs in every release checked (4.57 to 5.24); a
release that moves them to another is reported, not read as Swin's.
"""
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from ...ops.hooks import runs_hooks
from ...ops.position_bias import TableBias
from .hf_base import PROJECTIONS, SERVED_IMPLEMENTATIONS, HfAttentionAdapter
from .swin import table_position_bias

#: transformers 5.x's SwinAttention
_PROJECTIONS_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj", "relative_position_bias", "num_attention_heads",
                         "head_dim", "scaling", "attention_dropout", "config")


class HfSwinAdapter(HfAttentionAdapter):
    family = "hf_swin"
    hf_module = "transformers.models.swin.modeling_swin"
    hf_class = "SwinAttention"
    self_required = HfAttentionAdapter.self_required + ("relative_position_bias_table", "relative_position_index")
    projections_required = _PROJECTIONS_REQUIRED

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if self.layout(module) == PROJECTIONS:
            bias = module.relative_position_bias
            missing = [name for name in ("relative_position_bias_table", "relative_position_index", "window_size")
                       if not hasattr(bias, name)]
            if missing:
                return f"{type(module).__name__}.relative_position_bias has no {', '.join(missing)}"
        return super().unsupported(module)

    # -- the "projections" layout; "self_output" is hf_base's ---------------------------
    def window_size(self, module: nn.Module) -> Tuple[int, int]:
        if self.call_layout(module) == PROJECTIONS:
            return tuple(module.relative_position_bias.window_size)
        return super().window_size(module)

    def head_dim(self, module: nn.Module) -> int:
        return module.head_dim if self.call_layout(module) == PROJECTIONS else super().head_dim(module)

    def attn_drop(self, module: nn.Module) -> float:
        return float(module.attention_dropout) if self.call_layout(module) == PROJECTIONS else super().attn_drop(module)

    def in_features(self, module: nn.Module) -> int:
        return module.q_proj.in_features if self.call_layout(module) == PROJECTIONS else super().in_features(module)

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.call_layout(module) == PROJECTIONS:
            return torch.cat((module.q_proj(x), module.k_proj(x), module.v_proj(x)), dim=-1)
        return super().qkv(module, x)

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return module.o_proj(y) if self.call_layout(module) == PROJECTIONS else super().project(module, y)

    def keeps_transformers(self, module: nn.Module, hidden_states: torch.Tensor, arguments: Dict[str, Any]) -> bool:
        if self.call_layout(module) == PROJECTIONS:
            config = module.config
            # 5.x records attention weights (hooks on the stages) where the call or, failing
            # that, the config asks for them; only the call's argument reaches this module
            if arguments.get("output_attentions", getattr(config, "output_attentions", False)):
                return True
            if (config._attn_implementation not in SERVED_IMPLEMENTATIONS
                    or runs_hooks(module.relative_position_bias)):  # its forward is not called
                return True
        return super().keeps_transformers(module, hidden_states, arguments)

    # -- what the op takes ---------------------------------------------------------------
    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        holder = module.relative_position_bias if self.call_layout(module) == PROJECTIONS else module.self
        return table_position_bias(module, holder.relative_position_bias_table, holder.relative_position_index)

    def score_scale(self, module: nn.Module) -> Dict:
        if self.call_layout(module) == PROJECTIONS:
            return dict(scale=float(module.scaling))
        return dict(scale=self.head_dim(module) ** -0.5)


class HfDonutSwinAdapter(HfSwinAdapter):
    family = "hf_donut_swin"
    hf_module = "transformers.models.donut.modeling_donut_swin"
    hf_class = "DonutSwinAttention"
    projections_required = ()


class HfMaskFormerSwinAdapter(HfSwinAdapter):
    family = "hf_maskformer_swin"
    hf_module = "transformers.models.maskformer.modeling_maskformer_swin"
    hf_class = "MaskFormerSwinAttention"
    projections_required = ()
