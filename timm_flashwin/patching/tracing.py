"""Which tool is running a patched module, and what the patched forward does then.

One place for every tool that captures a model rather than running it
(README, "Tools: export, TorchScript, FX, ONNX"):

==========================  ===========================================================
tool                        a patched module (and the block holding it) runs
==========================  ===========================================================
eager, torch.compile,       the op (``timm_flashwin::window_attention_fwd`` / ``_bwd``,
torch.export                registered operators: in the compiled or exported graph)
torch.jit.script            timm's forward, compiled by TorchScript (the patched class's
                            forward names it behind ``torch.jit.is_scripting()``, which
                            TorchScript resolves statically; ``patching.classes.patched_class``)
torch.jit.trace             timm's forward (``torch.jit.is_tracing()``): the traced graph
                            is the unpatched model's
torch.fx symbolic tracing   timm's fx feature extraction (its tracer's leaf modules):
                            the patched module is a leaf, called by the GraphModule, which
                            runs the op; any other tracer (a ``torch.fx.Proxy`` input):
                            timm's forward, traced
ONNX export (TorchScript    timm's forward (``torch.onnx.is_in_onnx_export()``, and the
or dynamo exporter)         TorchScript exporter traces): the unpatched model's graph
==========================  ===========================================================

``runs_timm(x)`` is the test the patched forwards make, per call: plain attribute reads
in eager mode (host time, which eager steps of the tiny models are bound by).
"""
from __future__ import annotations

from typing import Iterable

import torch

_is_tracing = torch._C._is_tracing
_Proxy = torch.fx.Proxy

try:  # the flags torch.onnx.is_in_onnx_export() reads (torch 2.5+), read here without its imports per call
    from torch.onnx._internal.exporter import _flags as _onnx_flags
except ImportError:  # pragma: no cover - older torch
    _onnx_flags = None
try:
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS as _onnx_globals
except ImportError:  # pragma: no cover - older torch
    _onnx_globals = None


def onnx_exporting() -> bool:
    """``torch.onnx.is_in_onnx_export()``: either ONNX exporter is running."""
    if _onnx_flags is None or _onnx_globals is None:
        return torch.onnx.is_in_onnx_export()
    return _onnx_flags._is_onnx_exporting or _onnx_globals.in_onnx_export


def runs_timm(x) -> bool:
    """Whether a patched module's forward (or its block's window method) must run timm's own
    code on its input ``x`` rather than the op: torch.jit.trace, torch.fx symbolic tracing
    through the module (x a Proxy), ONNX export. torch.compile and torch.export keep the op
    (torch.onnx.export's dynamo exporter runs torch.export with its flag set: timm's code)."""
    if torch.compiler.is_compiling():
        return _onnx_flags._is_onnx_exporting if _onnx_flags is not None else torch.onnx.is_in_onnx_export()
    return _is_tracing() or isinstance(x, _Proxy) or onnx_exporting()


def register_fx_leaves(classes: Iterable[type]) -> None:
    """The patched classes are leaves of timm's fx tracer (its ``register_notrace_module``
    registry, which timm's fx feature extraction, ``features_only=True, feature_cls="fx"``
    and ``timm.layers.create_feature_extractor``, and its tests pass to torchvision's
    tracer): the GraphModule calls the patched module, which runs the op. Other tracers
    trace through it, and it runs timm's forward on their proxies (``runs_timm``)."""
    try:
        from timm.layers import register_notrace_module
    except ImportError:  # pragma: no cover - timm without fx helpers
        return
    for cls in classes:
        register_notrace_module(cls)
