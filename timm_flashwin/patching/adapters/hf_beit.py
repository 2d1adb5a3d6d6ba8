"""transformers' BEiT and Data2VecVision: ``beit.BeitAttention`` (BeitModel and its heads) and
``data2vec.Data2VecVisionAttention`` (Data2VecVisionModel and its heads): global attention
over the class token and the patches, S = Q K^T / sqrt(D) plus the relative-position bias.

transformers holds them in one of two layouts (``hf_base``'s names for the first):

- "projections" (BEiT from transformers 5.x): q_proj, k_proj (no bias), v_proj, o_proj; the
  layer (``BeitLayer``) computes the bias, the module's own table interpolated to the
  input's patch grid in every forward (``BeitRelativePositionBias``) plus the model's shared
  one, and passes it as ``attention_mask`` (1, H, N, N): the op takes it as its dense bias,
  whose gradient flows back through transformers' own interpolation and gather. Served
  with ``attn_implementation`` "eager" and "sdpa" (the op computes their math).
- "attention_output" (Data2VecVision in 5.x, BEiT in 4.x): ``.attention`` (query, key,
  value, a Dropout on the probabilities and, with ``use_relative_position_bias``, a
  ``relative_position_bias`` module) and ``.output`` (dense, dropout); forward(hidden_states,
  [head_mask,] output_attentions, relative_position_bias (the shared bias),
  interpolate_pos_encoding, resolution). The module's own bias is its
  ``relative_position_bias`` module's output for the call's resolution (called, as
  transformers calls it: its interpolation included), plus the shared one. ``.attention``
  is transformers' eager or SDPA class (both the same math), another class is reported.

transformers' own forward runs for a call that asks for attention weights, passes a head
mask or a mask other than one bias for every image, has more tokens than the op takes, or
would skip hooks on ``.attention`` / ``.output``.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ...ops.window_checks import MAX_TOKENS
from ...ops.hooks import runs_hooks
from .hf_base import PROJECTIONS, SERVED_IMPLEMENTATIONS, HfAttentionAdapter

ATTENTION_OUTPUT = "attention_output"

#: the "projections" layout (BEiT, transformers 5.x)
_PROJECTIONS_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj", "num_attention_heads", "head_dim", "scaling",
                         "attention_dropout", "config")
#: what ``.attention`` holds in the "attention_output" layout
_ATTENTION_REQUIRED = ("query", "key", "value", "dropout", "num_attention_heads", "attention_head_size", "config")


class HfBeitAdapter(HfAttentionAdapter):
    family = "hf_beit"
    hf_module = "transformers.models.beit.modeling_beit"
    hf_class = "BeitAttention"
    projections_required = _PROJECTIONS_REQUIRED
    #: the class-name prefix of the module's ``.attention`` classes (eager, SDPA)
    prefix = "Beit"

    # -- layout -----------------------------------------------------------------------
    def layout(self, module: nn.Module) -> Optional[str]:
        if self.projections_required and all(hasattr(module, name) for name in self.projections_required):
            return PROJECTIONS
        inner, output = getattr(module, "attention", None), getattr(module, "output", None)
        if (isinstance(inner, nn.Module) and all(hasattr(inner, name) for name in _ATTENTION_REQUIRED)
                and hasattr(output, "dense") and hasattr(output, "dropout")):
            return ATTENTION_OUTPUT
        return None

    def call_layout(self, module: nn.Module) -> str:
        return PROJECTIONS if "o_proj" in module._modules else ATTENTION_OUTPUT

    def attention(self, module: nn.Module) -> nn.Module:
        return module if self.call_layout(module) == PROJECTIONS else module.attention

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if self.layout(module) is None:
            import transformers
            return (f"transformers {transformers.__version__}: {type(module).__name__} has neither layout "
                    f"timm_flashwin reads ({', '.join(_PROJECTIONS_REQUIRED)}; or an .attention with "
                    f"{', '.join(_ATTENTION_REQUIRED)} and an .output with dense, dropout)")
        if self.call_layout(module) == ATTENTION_OUTPUT:
            inner = module.attention
            served = {f"{self.prefix}SelfAttention", f"{self.prefix}SdpaSelfAttention"}
            if type(inner).__name__ not in served or type(inner).__module__ != self.hf_module:
                return f".attention is a {type(inner).__name__}, not transformers' {' or '.join(sorted(served))}"
            bias = self.own_bias_module(module)
            if bias is not None and "window_size" not in inspect.signature(bias.forward).parameters:
                return f".attention.relative_position_bias ({type(bias).__name__}) takes no window_size"
        return HfAttentionAdapter.unsupported(self, module)

    @staticmethod
    def own_bias_module(module: nn.Module) -> Optional[nn.Module]:
        """The "attention_output" layout's own ``relative_position_bias`` module, or None."""
        inner = module.attention
        if not getattr(inner, "has_relative_position_bias", True):  # Data2VecVision's flag
            return None
        return getattr(inner, "relative_position_bias", None)

    # -- geometry ---------------------------------------------------------------------
    def window_size(self, module: nn.Module) -> None:
        return None  # global attention: the token count is checked per call

    def head_dim(self, module: nn.Module) -> int:
        return module.head_dim if self.call_layout(module) == PROJECTIONS else module.attention.attention_head_size

    def attn_drop(self, module: nn.Module) -> float:
        if self.call_layout(module) == PROJECTIONS:
            return float(module.attention_dropout)
        return float(module.attention.dropout.p)

    def in_features(self, module: nn.Module) -> int:
        return (module.q_proj if self.call_layout(module) == PROJECTIONS else module.attention.query).in_features

    # -- what the op takes ----------------------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.call_layout(module) == PROJECTIONS:
            return torch.cat((module.q_proj(x), module.k_proj(x), module.v_proj(x)), dim=-1)
        return super().qkv(module, x)

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        if self.call_layout(module) == PROJECTIONS:
            return module.o_proj(y)
        return module.output.dropout(module.output.dense(y))

    def position_bias(self, module: nn.Module) -> None:
        return None  # the call's (``call_bias``)

    def score_scale(self, module: nn.Module) -> Dict:
        if self.call_layout(module) == PROJECTIONS:
            return dict(scale=float(module.scaling))
        return dict(scale=self.head_dim(module) ** -0.5)

    # -- call time --------------------------------------------------------------------
    def _served_bias(self, module: nn.Module, bias, tokens: int) -> bool:
        """Whether ``bias`` (a mask or bias the call passes) is one (H, N, N) float bias for
        every image, which the op takes, or None."""
        if bias is None:
            return True
        heads = self.num_heads(module)
        return (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dim() in (3, 4)
                and tuple(bias.shape[-3:]) == (heads, tokens, tokens) and (bias.dim() == 3 or bias.shape[0] == 1))

    def keeps_transformers(self, module: nn.Module, hidden_states: torch.Tensor, arguments: Dict[str, Any]) -> bool:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return True
        tokens = hidden_states.shape[1]
        if tokens > MAX_TOKENS or arguments.get("head_mask") is not None:
            return True
        if self.call_layout(module) == PROJECTIONS:
            config = module.config
            if arguments.get("output_attentions", getattr(config, "output_attentions", False)):
                return True
            return (config._attn_implementation not in SERVED_IMPLEMENTATIONS
                    or not self._served_bias(module, arguments.get("attention_mask"), tokens))
        if arguments.get("output_attentions") or runs_hooks(module.attention, module.output):
            return True
        if self.own_bias_module(module) is not None and arguments.get("resolution") is None:
            return True  # transformers' own forward says what is missing
        return not self._served_bias(module, arguments.get("relative_position_bias"), tokens)

    def call_bias(self, module: nn.Module, hidden_states: torch.Tensor,
                  arguments: Dict[str, Any]) -> Optional[torch.Tensor]:
        """The call's bias: the layer's ``attention_mask`` ("projections"), or the module's own
        bias for the call's resolution plus the shared one ("attention_output")."""
        if self.call_layout(module) == PROJECTIONS:
            return arguments.get("attention_mask")
        bias, shared = None, arguments.get("relative_position_bias")
        own = self.own_bias_module(module)
        if own is not None:
            height, width = arguments["resolution"]
            patch = module.attention.config.patch_size
            bias = own((height // patch, width // patch), arguments.get("interpolate_pos_encoding", False),
                       dim_size=hidden_states.shape[1])
        if shared is not None:
            bias = shared if bias is None else bias + shared
        return bias

    def hf_forward(self, module: nn.Module, hidden_states: torch.Tensor,
                   arguments: Dict[str, Any]) -> Tuple[Optional[torch.Tensor], ...]:
        """What transformers' forward returns without attention weights: ((B, N, C), None) in
        the "projections" layout and where ``.attention`` is the SDPA class, ((B, N, C),) else."""
        bias = self.call_bias(module, hidden_states, arguments)
        out = self._project(module, hidden_states, None, bias=bias)
        if self.call_layout(module) == PROJECTIONS or type(module.attention).__name__.endswith("SdpaSelfAttention"):
            return out, None
        return (out,)


class HfData2VecVisionAdapter(HfBeitAdapter):
    family = "hf_data2vec_vision"
    hf_module = "transformers.models.data2vec.modeling_data2vec_vision"
    hf_class = "Data2VecVisionAttention"
    projections_required = ()
    prefix = "Data2VecVision"
