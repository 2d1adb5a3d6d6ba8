"""Patching timm models: which modules are routed through the op, and how.

Mechanism: patching swaps a module's ``__class__`` to a subclass of its timm class
(``FlashSwinWindowAttention``, ``FlashSwinV2WindowAttention``,
``FlashSwinV2CrWindowMultiHeadAttention``, ``FlashMaxxVitAttentionCl``,
``FlashMaxxVitAttention2d``, ``FlashTinyVitAttention``, ...; ``classes.PATCHED_CLASSES``) whose
``forward`` calls the family's adapter.
The subclass adds no state (``recompute_qkv`` sets one plain instance attribute, a bool): it
survives ``copy.deepcopy``,
``torch.save(model)`` / ``torch.load`` (with timm_flashwin importable) and ``state_dict``
round trips, adds no parameter or buffer, shows in ``repr``, and unpatching (restoring
timm's class) restores timm's forward exactly.

Why not a wrapt wrapper on timm's ``forward``: torch.compile does not call it. When a module
is called by its parent, dynamo calls the function the wrapper wraps (timm's forward) and
compiles timm's attention with no graph break and no error (torch 2.11 and 2.14.1, wrapt
2.1.2; ``tests/test_patching_compile.py::test_why_not_wrapt`` checks it on the versions that run the
tests). A method of a subclass is what dynamo traces, and as dynamo guards on module types, a
patched and an unpatched copy of one model never share a graph.

Hugging Face transformers' Swin-family attention classes are patched the same way, by
subclasses made when first needed (``hf``; their adapters in ``adapters/hf_*.py``).

The timm block holding a patched Swin-family module as ``.attn`` gets a subclass the same way
(``FlashSwinTransformerBlock``, ...), whose window method (timm's ``_attn`` or
``_shifted_window_attn``: roll, partition, attention, merge, roll back) has the op read
the windows from the feature map instead (``WindowAttentionAdapter.block_attention``),
in eager mode, where the map is a whole number of windows and no hook on the module
would be skipped; elsewhere it is timm's method, which calls the patched module. Under
torch.compile inductor fuses the copies into their neighbours already (bench_feature_map.py,
removed at fc2fe00: no gain), and the compiled graphs stay what they were.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Iterator, Optional, Tuple, Union

from torch import nn

from . import hf as patching_hf
from .adapters import ADAPTERS, HF_ADAPTERS, WindowAttentionAdapter
from .adapters.base import BLOCK_GRID_ATTR, RECOMPUTE_QKV_ATTR
from .adapters.rel_pos import KEPT_ATTR
from .classes import BLOCK_FAMILY_ATTR as _BLOCK_FAMILY_ATTR, FAMILY_ATTR as _FAMILY_ATTR
from .classes import PATCHED_BLOCK_CLASSES, PATCHED_CLASSES
from ..ops.dispatch import model_road, unserved_device
from .report import ModuleStatus, PatchError, PatchReport

logger = logging.getLogger("timm_flashwin")

# the patched classes under this module's names too: pickles made before they moved to
# ``classes`` name them here
globals().update({cls.__name__: cls for cls in (*PATCHED_CLASSES.values(), *PATCHED_BLOCK_CLASSES.values())})

_SKIP_ATTR = "_flashwin_skipped"  # set on instances patch_model left alone: the reason
_CACHE_ATTR = "_flashwin_bias_cache"  # adapters.base.inference_cache

#: A user's per-module opt-out, as torchao's filter_fn: (module, qualified name) -> patch?
FilterFn = Callable[[nn.Module, str], bool]
#: ``patch_model``'s recompute_qkv: for every patched module or none, or per module
RecomputeQkv = Union[bool, FilterFn]


# --------------------------------------------------------------------------- helpers
def _attention_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module, Optional[WindowAttentionAdapter], str]]:
    """(name, module, adapter or None, family) for every timm (or torchvision's, or
    transformers') window-attention module. Subclasses of their classes get no adapter:
    their forward may differ (a served class that subclasses another, torchvision's
    ShiftedWindowAttentionV2, is its own family). What is not a module (a model's name, a
    state_dict) is a TypeError saying what is expected."""
    if not isinstance(model, nn.Module):
        hint = f"; build the model first, e.g. timm.create_model({model!r})" if isinstance(model, str) else ""
        raise TypeError(f"timm_flashwin expects a torch.nn.Module, got {type(model).__name__}{hint}")
    adapters = {**ADAPTERS, **HF_ADAPTERS}
    served = sorted(((adapter, cls) for adapter in adapters.values() if (cls := adapter.module_type()) is not None),
                    key=lambda served_class: -len(served_class[1].__mro__))  # subclasses before their bases
    exact = {cls: adapter for adapter, cls in served}
    for name, module in model.named_modules():
        cls = type(module)
        family = cls.__dict__.get(_FAMILY_ATTR)  # a patched class's own, not a subclass's of it
        adapter = adapters[family] if family is not None else exact.get(cls)
        if adapter is not None:
            yield name, module, adapter, adapter.family
            continue
        subclassed = next((adapter for adapter, served_class in served if isinstance(module, served_class)), None)
        if subclassed is not None:
            yield name, module, None, subclassed.family


#: the reason of the modules filter_fn opted out of: a choice, which strict does not count
EXCLUDED_BY_FILTER = "excluded by filter_fn"


def _patched_class_of(family: str) -> type:
    """The class a patched module of ``family`` takes."""
    return PATCHED_CLASSES[family] if family in PATCHED_CLASSES else patching_hf.patched_class(family)


def _skip_reason(module: nn.Module, adapter: Optional[WindowAttentionAdapter], family: str, name: str,
                 filter_fn: Optional[FilterFn]) -> Optional[str]:
    """Why ``module`` keeps timm's forward, or None where it is patched."""
    if filter_fn is not None and not filter_fn(module, name):
        return EXCLUDED_BY_FILTER
    if adapter is None:
        owner = "transformers'" if family in HF_ADAPTERS else "timm's"
        return f"{type(module).__name__} subclasses {owner} class; its forward may differ"
    return adapter.unsupported(module)


def _is_patched(module: nn.Module) -> bool:
    return getattr(type(module), _FAMILY_ATTR, None) is not None


def _clear(module: nn.Module) -> None:
    if _is_patched(module):
        module.__class__ = type(module).__mro__[1]  # timm's class
    for attr in (_SKIP_ATTR, _CACHE_ATTR, RECOMPUTE_QKV_ATTR, KEPT_ATTR):
        module.__dict__.pop(attr, None)


def _blocks(model: nn.Module) -> Iterator[Tuple[nn.Module, str]]:
    """(block, family) for every timm block of its family's exact class, or ours."""
    for block in model.modules():
        family = getattr(type(block), _BLOCK_FAMILY_ATTR, None)
        if family is None:
            family = next((f for f in PATCHED_BLOCK_CLASSES if type(block) is ADAPTERS[f].block_type()), None)
        if family is not None:
            yield block, family


def _set_block_class(block: nn.Module, cls: type) -> None:
    block.__class__ = cls
    if getattr(cls, _BLOCK_FAMILY_ATTR, None) is None:
        block.__dict__.pop(BLOCK_GRID_ATTR, None)


def _sync_blocks(model: nn.Module, feature_map: bool) -> None:
    """Give every timm block holding a window-attention module as ``.attn`` the patched
    block class where that module is patched and ``feature_map`` is set, else timm's class
    back."""
    for block, family in _blocks(model):
        served = feature_map and type(getattr(block, "attn", None)) is PATCHED_CLASSES[family]
        _set_block_class(block, PATCHED_BLOCK_CLASSES[family] if served else ADAPTERS[family].block_type())


def _status(name: str, module: nn.Module, adapter: Optional[WindowAttentionAdapter], family: str,
            parent: Optional[nn.Module]) -> ModuleStatus:
    layout = adapter.describe(module, parent) if adapter is not None else None
    if _is_patched(module):
        return ModuleStatus(name, family, True, layout=layout)
    reason = getattr(module, _SKIP_ATTR, None) or "not patched"
    return ModuleStatus(name, family, False, reason=reason, layout=layout)


# ------------------------------------------------------------------------ public API
def patch_model(model: nn.Module, *, strict: bool = False, filter_fn: Optional[FilterFn] = None,
                recompute_qkv: RecomputeQkv = False, feature_map: bool = True) -> nn.Module:
    """Route every timm (or transformers' Swin-family) window-attention module of ``model``
    through the fused op, in place.

    Works wherever the modules sit (timm models, features_only wrappers, a user's
    nn.Module, DistributedDataParallel). Each module keeps its own parameters, read at
    call time. Patching twice patches nothing more (``recompute_qkv`` is set anew on every
    patched module). Modules the op cannot serve keep timm's forward;
    ``patch_report(model)`` says which and why.

    Args:
        model: any nn.Module.
        strict: raise ``PatchError`` (a ValueError) listing every module that cannot be
            served, and patch nothing; or saying there is nothing to patch.
            Modules ``filter_fn`` opts out of are not counted: they are left on purpose.
        filter_fn: ``(module, qualified_name) -> bool``; False keeps that module on timm.
        recompute_qkv: where gradients are recorded, do not keep the qkv projection's output
            (B_, N, 3 C) for the backward but compute it again there from the module's
            input (selective activation checkpointing; the op's own outputs are kept): less
            memory for one more qkv matmul per module and training step. Gradients are the
            same; eager mode and torch.compile alike. True: every patched module; or
            ``(module, qualified_name) -> bool`` (as filter_fn) for some of them. What a
            stage's recomputation costs differs: swin_tiny, batch 64 AMP training steps,
            torch.compile with CUDA graphs, H200, peak memory and speed against the model
            patched without it: True 0.81x memory, 0.94x speed; the first stage's modules
            (names starting "layers.0.") 0.92x, 0.95x; the second's ("layers.1.") 0.96x,
            1.00x; the third's 0.95x, 0.98x (47adaeb, 0447d84: benchmarks/results/). In eager mode the
            checkpointing's dispatch adds host work per step (a host-bound step slows).
        feature_map: let the timm block around each patched module have the op read its
            windows from the (B, H, W, C) map and write them back there (no roll,
            partition, merge and roll-back copies; eager mode, maps that are a whole number
            of windows, no hooks on the module: else timm's method runs). False keeps
            timm's method in every block; the modules are patched all the same.

    Returns:
        ``model`` itself.
    """
    if not (isinstance(recompute_qkv, bool) or callable(recompute_qkv)):
        raise TypeError(f"patch_model: recompute_qkv must be a bool or a callable (module, qualified_name) -> bool, "
                        f"got {type(recompute_qkv).__name__}")
    found = list(_attention_modules(model))
    model_name = type(model).__name__
    if not found:
        if strict:
            raise PatchError(model_name, {})
        warnings.warn(f"timm_flashwin: {model_name} has no timm window-attention module to patch", stacklevel=2)
        return model
    device = unserved_device(model)  # a GPU the kernels do not serve in the model's dtype
    reasons = {name: why for name, module, adapter, family in found
               if not _is_patched(module)
               and (why := _skip_reason(module, adapter, family, name, filter_fn) or device) is not None}
    if device is not None and not strict:
        warnings.warn(f"timm_flashwin: {device}; {model_name} keeps its own attention", RuntimeWarning, stacklevel=2)
    failures = {name: why for name, why in reasons.items() if why != EXCLUDED_BY_FILTER}
    if strict and failures:
        raise PatchError(model_name, failures)
    for name, module, adapter, family in found:
        if name in reasons:
            module.__dict__[_SKIP_ATTR] = reasons[name]
            continue
        if not _is_patched(module):
            module.__dict__.pop(_SKIP_ATTR, None)
            module.__class__ = _patched_class_of(family)
        if recompute_qkv is True or (callable(recompute_qkv) and recompute_qkv(module, name)):
            module.__dict__[RECOMPUTE_QKV_ATTR] = True
        else:
            module.__dict__.pop(RECOMPUTE_QKV_ATTR, None)
    _sync_blocks(model, feature_map)
    report = patch_report(model)  # a WARNING where modules cannot be served; filter_fn's choices are no news
    level = logging.WARNING if any(m.reason != EXCLUDED_BY_FILTER for m in report.skipped) else logging.INFO
    logger.log(level, "timm_flashwin: %s", report.summary())
    for status in report.modules:
        logger.debug("timm_flashwin: %s [%s] %s", status.name or "<model>", status.family,
                     "patched" if status.patched else f"skipped: {status.reason}")
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Give every window-attention module of ``model`` timm's forward back (and their
    blocks timm's window method), in place."""
    for _, module, _, _ in _attention_modules(model):
        _clear(module)
    _sync_blocks(model, False)
    return model


def is_patched(module_or_model: nn.Module) -> bool:
    """For a window-attention module: whether it is patched. For any other module:
    whether any window-attention module inside it is."""
    return any(_is_patched(m) for _, m, _, _ in _attention_modules(module_or_model))


def patch_report(model: nn.Module) -> PatchReport:
    """The current state of every attention module of ``model`` that an adapter knows, and what
    computes the patched ones where its parameters are now (``PatchReport.road``)."""
    parents = dict(model.named_modules()) if isinstance(model, nn.Module) else {}
    modules = [_status(*entry, parents.get(entry[0].rpartition(".")[0])) for entry in _attention_modules(model)]
    return PatchReport(type(model).__name__, modules, model_road(model) if any(m.patched for m in modules) else None)


@contextlib.contextmanager
def patched(model: nn.Module, **kwargs) -> Iterator[nn.Module]:
    """``with patched(model): ...``: patch_model on entry; on exit (also on an exception)
    unpatch exactly the modules this call patched and give the blocks their classes back.
    kwargs go to ``patch_model``."""
    before = {id(m): m.__dict__.get(RECOMPUTE_QKV_ATTR) for _, m, _, _ in _attention_modules(model)
              if _is_patched(m)}
    block_classes = [(block, type(block)) for block, _ in _blocks(model)]
    patch_model(model, **kwargs)
    try:
        yield model
    finally:
        for _, module, _, _ in _attention_modules(model):
            if id(module) not in before:
                _clear(module)
            elif before[id(module)] is None:  # patched before: its recompute_qkv as it was
                module.__dict__.pop(RECOMPUTE_QKV_ATTR, None)
            else:
                module.__dict__[RECOMPUTE_QKV_ATTR] = before[id(module)]
        for block, cls in block_classes:
            _set_block_class(block, cls)
