"""The patched subclasses of Hugging Face transformers' attention classes.

``patching`` swaps a module's ``__class__`` to one of these, as it does for timm's classes
(its docstring says why a subclass). They are made when first needed, not when
timm_flashwin is imported: transformers is an optional dependency and importing it takes
seconds. Each lives here under a module-level name (``FlashSwinAttention``,
``FlashSwinv2Attention``, ...) that this module's ``__getattr__`` makes on demand, so that
a pickled patched model loads where transformers and timm_flashwin are importable.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Dict

import torch

from .adapters import HF_ADAPTERS
from .adapters.hf_base import HfAttentionAdapter
from .tracing import runs_timm

_FAMILY_ATTR = "_flashwin_family"  # as patching's

#: family -> its patched class, once made
_MADE: Dict[str, type] = {}


def class_name(adapter: HfAttentionAdapter) -> str:
    return f"Flash{adapter.hf_class}"


def patched_class(family: str) -> type:
    """The patched subclass of ``family``'s transformers class, made on the first call
    (its modeling module must be imported: an instance of it exists)."""
    cls = _MADE.get(family)
    if cls is None:
        cls = _MADE[family] = globals()[class_name(HF_ADAPTERS[family])] = _make_class(HF_ADAPTERS[family])
    return cls


def _make_class(adapter: HfAttentionAdapter) -> type:
    hf_class = adapter.module_type()
    hf_forward = hf_class.forward
    if hasattr(adapter, "patched_forward"):  # a forward of another signature than the Swin family's
        return _subclass(adapter, hf_class, adapter.patched_forward(hf_forward))
    # the names of the positional arguments after hidden_states: the Swin family's
    # attention_mask, then 4.x's (head_mask, output_attentions), 5.x's self_output layout's
    # (output_attentions,), none more in 5.x's SwinAttention (**kwargs); Data2VecVision's
    # (output_attentions, relative_position_bias, interpolate_pos_encoding, resolution)
    positional = [p.name for p in inspect.signature(hf_forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][2:]

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        arguments = dict(zip(positional, args), **kwargs)
        if runs_timm(hidden_states) or adapter.keeps_transformers(self, hidden_states, arguments):
            return hf_forward(self, hidden_states, *args, **kwargs)
        return adapter.hf_forward(self, hidden_states, arguments)
    return _subclass(adapter, hf_class, forward)


def _subclass(adapter: HfAttentionAdapter, hf_class: type, forward) -> type:
    def extra_repr(self) -> str:
        text = hf_class.extra_repr(self)
        return f"{text}, flashwin={adapter.family}" if text else f"flashwin={adapter.family}"

    name = class_name(adapter)
    return type(name, (hf_class,), {
        "forward": forward, "extra_repr": extra_repr, _FAMILY_ATTR: adapter.family,
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"transformers' {hf_class.__module__}.{hf_class.__qualname__}, patched by timm_flashwin.",
    })


def __getattr__(name: str) -> type:
    """``FlashSwinAttention`` and the others, made on first access (pickle's lookup)."""
    for family, adapter in HF_ADAPTERS.items():
        if class_name(adapter) == name:
            importlib.import_module(adapter.hf_module)
            if adapter.module_type() is not None:
                return patched_class(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
