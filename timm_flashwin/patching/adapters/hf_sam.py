"""SAM's image encoder and ViTDet's backbone in Hugging Face transformers: ``SamVisionAttention``
and ``SamVisionSdpaAttention`` (``SamModel``, ``SamVisionModel``), SAM-HQ's
``SamHQVisionAttention`` / ``SamHQVisionSdpaAttention``, and ``VitDetAttention``
(``VitDetModel``, ``VitDetBackbone``), with relative positions (``use_rel_pos``,
``use_relative_position_embeddings``): decomposed relative position (``decomposed``).

Their forward takes hidden_states (B, H, W, C) and returns (output, attention weights or None)
(SAM) or (output,) / (output, probabilities) (ViTDet); each gathers its tables with its own
``get_rel_pos`` (SAM's a method that interpolates them always, ViTDet's a function), which
``ops.rel_pos.gathered_table`` computes. The
eager classes compute the attention weights: where a caller collects them
(``output_attentions``, or transformers' output capturing asks for "attentions") the call
runs transformers' forward. SAM's eager class drops probabilities with ``config.attention_dropout``
in training, its SDPA class never does; ViTDet has no attention dropout.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Type

import torch
from torch import nn

from ..tracing import runs_timm
from .decomposed import DecomposedRelPosAdapter


def _collecting_attentions() -> bool:
    """Whether transformers' output capturing (5.x) is collecting attention weights now."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return collected is not None and "attentions" in collected


class HfDecomposedAdapter(DecomposedRelPosAdapter):
    """transformers' classes: found in their modeling module once it is imported (``hf``)."""

    hf_module: str = ""
    hf_class: str = ""
    #: whether the class computes attention weights (its eager form), which a caller may collect
    returns_weights: bool = False
    required = ("qkv", "proj", "rel_pos_h", "rel_pos_w", "num_attention_heads", "scale")

    def module_type(self) -> Optional[Type[nn.Module]]:
        modeling = sys.modules.get(self.hf_module)
        return getattr(modeling, self.hf_class, None) if modeling is not None else None

    def num_heads(self, module: nn.Module) -> int:
        return module.num_attention_heads

    def attn_drop(self, module: nn.Module) -> float:
        return float(module.dropout) if self.returns_weights else 0.0

    #: SAM's get_rel_pos interpolates its tables in every call (ViTDet's where it must)
    interpolates_always = True

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return module.proj(y)

    def keeps_transformers(self, module: nn.Module, arguments: Dict[str, Any]) -> bool:
        """Whether this call runs transformers' forward: attention weights asked for."""
        return self.returns_weights and (bool(arguments.get("output_attentions")) or _collecting_attentions())

    def hf_forward(self, module: nn.Module, hidden_states: torch.Tensor) -> tuple:
        """(output (B, H, W, C), None), as transformers' forward without attention weights."""
        return self.forward(module, hidden_states), None

    def patched_forward(self, hf_forward: Callable) -> Callable:
        """The patched class's forward: transformers' signature (hidden_states, output_attentions),
        its forward where ``keeps_transformers`` (or a tool runs the original code,
        ``tracing.runs_timm``), else the op's."""
        adapter = self

        def forward(self, hidden_states: torch.Tensor, output_attentions: Optional[bool] = None, *args, **kwargs):
            if (args or kwargs or runs_timm(hidden_states)
                    or adapter.keeps_transformers(self, dict(output_attentions=output_attentions))):
                return hf_forward(self, hidden_states, output_attentions, *args, **kwargs)
            return adapter.hf_forward(self, hidden_states)
        return forward


class HfSamVisionAdapter(HfDecomposedAdapter):
    family = "hf_sam"
    hf_module = "transformers.models.sam.modeling_sam"
    hf_class = "SamVisionAttention"
    returns_weights = True


class HfSamVisionSdpaAdapter(HfDecomposedAdapter):
    family = "hf_sam_sdpa"
    hf_module = "transformers.models.sam.modeling_sam"
    hf_class = "SamVisionSdpaAttention"


class HfSamHqVisionAdapter(HfDecomposedAdapter):
    family = "hf_sam_hq"
    hf_module = "transformers.models.sam_hq.modeling_sam_hq"
    hf_class = "SamHQVisionAttention"
    returns_weights = True


class HfSamHqVisionSdpaAdapter(HfDecomposedAdapter):
    family = "hf_sam_hq_sdpa"
    hf_module = "transformers.models.sam_hq.modeling_sam_hq"
    hf_class = "SamHQVisionSdpaAttention"


class HfVitDetAdapter(HfDecomposedAdapter):
    family = "hf_vitdet"
    interpolates_always = False
    hf_module = "transformers.models.vitdet.modeling_vitdet"
    hf_class = "VitDetAttention"
    returns_weights = True
    required = ("qkv", "proj", "rel_pos_h", "rel_pos_w", "num_heads", "scale")

    def num_heads(self, module: nn.Module) -> int:
        return module.num_heads

    def uses_rel_pos(self, module: nn.Module) -> bool:
        return bool(getattr(module, "use_relative_position_embeddings", False))

    def attn_drop(self, module: nn.Module) -> float:
        return 0.0

    def hf_forward(self, module: nn.Module, hidden_states: torch.Tensor) -> tuple:
        return (self.forward(module, hidden_states),)
