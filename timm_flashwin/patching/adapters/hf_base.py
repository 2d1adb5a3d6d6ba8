"""What the adapters of Hugging Face transformers' Swin family share.

transformers holds the attention of its Swin-family models in one of two layouts, and the
patched module is the ``XxxAttention`` class in both (it exists under that name in 4.x and
5.x), so that the output projection is inside the patched forward:

- "projections" (Swin from transformers 5.x): ``SwinAttention`` holds q_proj, k_proj,
  v_proj, o_proj and a ``SwinRelativePositionBias`` child (the table and a flat index);
  forward(hidden_states, attention_mask, **kwargs) -> (output, attention weights or None).
- "self_output" (every 4.x release; Swinv2, DonutSwin, MaskFormerSwin and Swin2SR in 5.x):
  ``XxxAttention`` holds ``.self`` (query, key, value Linear layers, the bias source, a
  Dropout on the probabilities) and ``.output`` (dense, dropout);
  forward(hidden_states, attention_mask, [head_mask,] output_attentions) ->
  (output,) or (output, attention probabilities).

The mask the layer passes in both is its shift mask, (nW, N, N), 0 / -100: the op's own.
A module in neither layout (another transformers release) is reported, never guessed.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple, Type

import torch
from torch import nn

from ...ops.hooks import runs_hooks
from .base import WindowAttentionAdapter

PROJECTIONS = "projections"
SELF_OUTPUT = "self_output"

#: attention implementations whose math the op computes (transformers' own eager and SDPA)
SERVED_IMPLEMENTATIONS = ("eager", "sdpa")


class HfAttentionAdapter(WindowAttentionAdapter):
    """Routes one transformers attention class through ``window_attention``.

    Subclasses name the class (``hf_module``, ``hf_class``), what their ``.self`` holds in
    the "self_output" layout (``self_required``) and whether they read the "projections"
    layout too. q, k and v come from calling the module's own Linear layers (their hooks
    run, as would those of a layer put in their place) and are concatenated into the
    (B_, N, 3C) qkv the op reads: one copy of the projections' outputs.
    """

    #: transformers' modeling module and the attention class in it that is patched
    hf_module: str = ""
    hf_class: str = ""
    #: attributes of ``.self`` the forward reads in the "self_output" layout
    self_required: Tuple[str, ...] = ("query", "key", "value", "dropout", "num_attention_heads",
                                      "attention_head_size", "window_size")
    #: attributes the "projections" layout needs; () where the family has no such layout
    projections_required: Tuple[str, ...] = ()
    forward_arg = "attention_mask"

    def module_type(self) -> Optional[Type[nn.Module]]:
        """transformers' class, or None where its modeling module is not imported (then no
        instance of it can exist: nothing imports transformers here)."""
        modeling = sys.modules.get(self.hf_module)
        return getattr(modeling, self.hf_class, None) if modeling is not None else None

    # -- layout -----------------------------------------------------------------------
    def layout(self, module: nn.Module) -> Optional[str]:
        """PROJECTIONS, SELF_OUTPUT, or None: neither layout this adapter reads. Checks every
        attribute the forward reads: at patch time (``unsupported``)."""
        if self.projections_required and all(hasattr(module, name) for name in self.projections_required):
            return PROJECTIONS
        inner, output = getattr(module, "self", None), getattr(module, "output", None)
        if (inner is not None and output is not None and all(hasattr(inner, name) for name in self.self_required)
                and hasattr(output, "dense") and hasattr(output, "dropout")):
            return SELF_OUTPUT
        return None

    def call_layout(self, module: nn.Module) -> str:
        """The layout of a module ``layout`` accepted when it was patched, from one submodule's
        name: what the forward asks, several times per call (host time)."""
        return PROJECTIONS if self.projections_required and "o_proj" in module._modules else SELF_OUTPUT

    def attention(self, module: nn.Module) -> nn.Module:
        """The module holding q, k, v and the position bias: the module itself or its ``.self``."""
        return module if self.call_layout(module) == PROJECTIONS else module.self

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if self.layout(module) is None:
            import transformers
            wanted = f"a .self with {', '.join(self.self_required)} and an .output with dense, dropout"
            if self.projections_required:
                wanted = f"{', '.join(self.projections_required)}; or {wanted}"
            return (f"transformers {transformers.__version__}: {type(module).__name__} has neither layout "
                    f"timm_flashwin reads ({wanted})")
        return super().unsupported(module)

    # -- geometry ---------------------------------------------------------------------
    def window_size(self, module: nn.Module) -> Tuple[int, int]:
        return tuple(self.attention(module).window_size)

    def num_heads(self, module: nn.Module) -> int:
        return self.attention(module).num_attention_heads

    def head_dim(self, module: nn.Module) -> int:
        return self.attention(module).attention_head_size

    def attn_drop(self, module: nn.Module) -> float:
        return float(self.attention(module).dropout.p)

    def in_features(self, module: nn.Module) -> int:
        return self.attention(module).query.in_features

    # -- what the forward computes ----------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        attention = self.attention(module)
        return torch.cat((attention.query(x), attention.key(x), attention.value(x)), dim=-1)

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return module.output.dropout(module.output.dense(y))

    # -- call time --------------------------------------------------------------------
    def keeps_transformers(self, module: nn.Module, hidden_states: torch.Tensor, arguments: Dict[str, Any]) -> bool:
        """Whether this call runs transformers' own forward: attention weights asked for
        (``output_attentions``, which only transformers' path computes), a head mask (4.x),
        a mask other than the (nW, N, N) shift mask, or hooks on a submodule whose forward
        the op replaces. ``arguments``: the call's arguments after hidden_states, by name."""
        if arguments.get("output_attentions") or arguments.get("head_mask") is not None:
            return True
        mask = arguments.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 3):
            return True
        if self.call_layout(module) == SELF_OUTPUT:
            return runs_hooks(module.self, module.output)
        return False

    def hf_forward(self, module: nn.Module, hidden_states: torch.Tensor,
                   arguments: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        """Replacement of the module's forward: hidden_states (B_, N, C) and the shift mask
        (nW, N, N) or None (``arguments["attention_mask"]``) -> what transformers' forward
        returns without attention weights: ((B_, N, C), None) in the "projections" layout,
        ((B_, N, C),) in "self_output"."""
        out = self.forward(module, hidden_states, arguments.get("attention_mask"))
        return (out, None) if self.call_layout(module) == PROJECTIONS else (out,)
