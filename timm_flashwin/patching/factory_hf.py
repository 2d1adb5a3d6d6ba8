"""Patched models from Hugging Face transformers' constructors: ``patch_transformers``,
``unpatch_transformers``, ``patched_transformers`` (``timm-flashwin run`` opens it beside
``factory.patched_timm``).

While active, every model that ``PreTrainedModel.from_pretrained`` or
``PreTrainedModel._from_config`` returns (so ``SwinForImageClassification.from_pretrained``,
``AutoModel.from_pretrained``, ``AutoModel.from_config``, ``VisionEncoderDecoderModel``'s
encoder, ...) is patched (``patch_model`` with the arguments given) before its caller sees
it. Models without a window-attention module are returned as built, with no warning.

How: one ``wrapt.FunctionWrapper`` around each of the two classmethods, set on
``PreTrainedModel`` itself (subclasses inherit it; transformers' own classes do not define
them again) and taken off again on deactivation. They run outside any compiled region, as
timm's factory (``factory``'s docstring). A model built by calling its class,
``SwinModel(config)``, is not reached: ``patch_model`` it. If transformers is not imported
yet, a wrapt post-import hook installs the wrappers once it is; timm_flashwin never
imports transformers itself.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import wrapt

from .factory import CreatedModel, _options, patching_call, recording

_MODELING = "transformers.modeling_utils"
_METHODS = ("from_pretrained", "_from_config")

_lock = threading.RLock()
_settings: Optional[Dict[str, Any]] = None  # patch_model's keyword arguments while active, else None
_recorders: List[List[CreatedModel]] = []  # one list per open patched_transformers()
_originals: Dict[str, Any] = {}  # method name -> PreTrainedModel's own classmethod, while wrapped
_hook_registered = False
_calls = threading.local()  # .inside: a constructor call of this thread is running (one calling the other)


def _construct(wrapped: Callable, instance: Any, args: tuple, kwargs: dict):
    return patching_call(wrapped, args, kwargs, _settings, _calls, _recorders,
                         lambda model: str(args[0]) if args and isinstance(args[0], (str, os.PathLike))
                         else type(model).__name__)


def _install() -> None:
    base = sys.modules[_MODELING].PreTrainedModel
    for method in _METHODS:
        if method not in _originals:
            _originals[method] = base.__dict__[method]
            setattr(base, method, wrapt.FunctionWrapper(_originals[method], _construct))


def _uninstall() -> None:
    modeling = sys.modules.get(_MODELING)
    for method, original in list(_originals.items()):
        setattr(modeling.PreTrainedModel, method, original)
        del _originals[method]


def _on_transformers_imported(module) -> None:
    with _lock:
        if _settings is not None:
            _install()


def patch_transformers(**patch_kwargs: Any) -> None:
    """Patch every model transformers' ``from_pretrained`` / ``from_config`` returns from now
    on, until ``unpatch_transformers()``. ``patch_kwargs`` are ``patch_model``'s; calling
    it again while active replaces them."""
    global _settings, _hook_registered
    settings = _options(patch_kwargs, "patch_transformers")
    with _lock:
        _settings = settings
        if _MODELING in sys.modules:
            _install()
        elif not _hook_registered:  # fires once, when transformers' modeling module is imported
            _hook_registered = True
            wrapt.register_post_import_hook(_on_transformers_imported, _MODELING)


def unpatch_transformers() -> None:
    """Give transformers its constructors back; models already created stay patched."""
    global _settings
    with _lock:
        _settings = None
        _uninstall()


@contextlib.contextmanager
def patched_transformers(**patch_kwargs: Any) -> Iterator[List[CreatedModel]]:
    """``with patched_transformers(**patch_kwargs) as created:``: ``patch_transformers`` on
    entry; on exit (also on an exception) the constructors as they were on entry.
    ``created`` lists the models they returned inside, each with its patch report."""
    with recording(_lock, _recorders, _settings, patch_transformers, unpatch_transformers, patch_kwargs) as created:
        yield created
