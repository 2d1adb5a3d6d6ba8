"""Patched models from timm's own factory: ``patch_timm``, ``unpatch_timm``, ``patched_timm``.

While active, every model ``timm.create_model`` returns is patched (``patch_model`` with
the arguments given) before its caller sees it, so that a script timm_flashwin never
edits (timm's train.py, validate.py, a lab's fork of them) trains the patched model.
Models without a timm window-attention module (ResNet, ViT, ...) are returned as timm
built them, with no warning; ``strict`` applies to the models with window attention.

How: one ``wrapt.FunctionWrapper`` around the function ``timm.models._factory`` defines.
The factory runs outside any compiled region, so dynamo's handling of wrapt proxies
(``tests/test_patching_compile.py::test_why_not_wrapt``, why modules are patched by class) does
not apply to it. Activation puts the wrapper at every module-level name that holds timm's
function: ``timm.models._factory.create_model``, ``timm.models.create_model``,
``timm.create_model``, and the globals of any module already loaded (``__main__``
included) that ran ``from timm import create_model`` before activation. Modules loaded while
active bind the wrapper by their own imports. Deactivation puts timm's function object itself
back at every module-level name that holds the wrapper, and nowhere else.

Limits: a reference to timm's function held elsewhere before activation (a local variable,
a default argument, an attribute, a closure) is not a module-level name and keeps calling
timm's function, unpatched. A reference to the wrapper kept past deactivation calls timm's
function and patches nothing (it patches again while active).

If timm is not imported yet, a wrapt post-import hook installs the wrapper once it is.
(``patch_timm`` checks its arguments against ``patch_model``, whose module imports timm,
so timm is imported by then today; the hook keeps this module independent of that.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import wrapt

from .report import PatchReport  # not from patching.py, which imports timm: that is imported where it is used

logger = logging.getLogger("timm_flashwin")

_TIMM = "timm"  # the hook's module: timm's namespaces are bound once it has run
_FACTORY_MODULE = "timm.models._factory"  # where timm defines create_model
_FACTORY_NAME = "create_model"

_lock = threading.RLock()
_settings: Optional[Dict[str, Any]] = None  # patch_model's keyword arguments while active, else None
_recorders: List[List["CreatedModel"]] = []  # one list per open patched_timm()
_pair: Optional[Tuple[Callable, wrapt.FunctionWrapper]] = None  # (timm's function, its wrapper)
_hook_registered = False
_calls = threading.local()  # .inside: a factory call of this thread is running (timm calling itself)


@dataclass
class CreatedModel:
    """A model timm's factory returned while ``patched_timm`` was open."""

    name: str  # the model name the factory was called with
    report: PatchReport  # the model's window-attention modules as the factory returned it

    def __str__(self) -> str:
        if not self.report.modules:
            return f"{self.name}: {self.report.model} has no timm window attention; returned as timm built it"
        return f"{self.name}: {self.report}"


# ----------------------------------------------------------------------- the wrapper
def _patch_created(model: Any, settings: Dict[str, Any]) -> PatchReport:
    from .model import patch_model, patch_report
    report = patch_report(model)
    if not report.modules:
        logger.debug("timm_flashwin: %s has no timm window attention; left as timm built it", report.model)
        return report
    patch_model(model, **settings)  # logs the report's summary once (details at DEBUG)
    # no road: where a model is when the factory returns it (the CPU) says nothing of where it runs
    return dataclasses.replace(patch_report(model), road=None)


def patching_call(wrapped: Callable, args: tuple, kwargs: dict, settings: Optional[Dict[str, Any]],
                  calls: threading.local, recorders: List[List[CreatedModel]], name: Callable[[Any], str]):
    """``wrapped(*args, **kwargs)``, the model it returns patched with ``settings`` (None:
    not active) and recorded as ``name(model)`` in every list of ``recorders``; a call made
    inside another (``calls.inside``: a constructor calling itself) is left to the outer one."""
    if settings is None or getattr(calls, "inside", False):
        return wrapped(*args, **kwargs)
    calls.inside = True
    try:
        model = wrapped(*args, **kwargs)
    finally:
        calls.inside = False
    report = _patch_created(model, settings)
    for created in list(recorders):
        created.append(CreatedModel(name(model), report))
    return model


def _create_model(wrapped: Callable, instance: Any, args: tuple, kwargs: dict):
    return patching_call(wrapped, args, kwargs, _settings, _calls, _recorders,
                         lambda model: str(args[0] if args else kwargs.get("model_name", "?")))


def timm_create_model() -> Callable:
    """timm's own ``create_model``, whether ``patch_timm`` is active or not: what the
    library's own tools build with (``verify`` compares a patched model with timm's, so it
    must get timm's unpatched model under ``patched_timm`` too)."""
    current = getattr(sys.modules.get(_FACTORY_MODULE), _FACTORY_NAME, None)
    if current is None:
        import timm.models._factory as factory
        current = factory.create_model
    return _pair[0] if _pair is not None and current is _pair[1] else current


# ------------------------------------------------------------- installing, restoring
def _rebind(old: Any, new: Any) -> None:
    """Every module-level name bound to ``old`` (by identity) is bound to ``new``."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        namespace = module.__dict__
        for key, value in list(namespace.items()):
            if value is old:
                namespace[key] = new


def _install() -> None:
    global _pair
    current = getattr(sys.modules.get(_FACTORY_MODULE), _FACTORY_NAME, None)
    if current is None:
        raise RuntimeError(f"timm_flashwin: {_FACTORY_MODULE}.{_FACTORY_NAME} not found (timm "
                           f"{getattr(sys.modules.get(_TIMM), '__version__', '?')})")
    if _pair is None or (current is not _pair[0] and current is not _pair[1]):
        _pair = (current, wrapt.FunctionWrapper(current, _create_model))  # one wrapper per timm function
    _rebind(_pair[0], _pair[1])


def _uninstall() -> None:
    if _pair is not None:
        _rebind(_pair[1], _pair[0])


def _on_timm_imported(module: types.ModuleType) -> None:
    with _lock:
        if _settings is not None:
            _install()


def _options(kwargs: Dict[str, Any], caller: str = "patch_timm") -> Dict[str, Any]:
    from .model import patch_model
    signature = inspect.signature(patch_model)
    try:
        signature.bind(None, **kwargs)
    except TypeError as exc:
        names = ", ".join(p for p in signature.parameters if p != "model")
        raise TypeError(f"{caller}: {exc}; patch_model takes {names}") from None
    return dict(kwargs)


# ------------------------------------------------------------------------ public API
def patch_timm(**patch_kwargs: Any) -> None:
    """Patch every model timm's factory returns from now on, until ``unpatch_timm()``.

    ``patch_kwargs`` are ``patch_model``'s (strict, filter_fn, recompute_qkv, feature_map);
    they apply to every model with timm window attention created while active. Calling it
    again while active replaces them (the wrapper is installed once). Each patched model's
    report summary is logged once on the ``timm_flashwin`` logger, as ``patch_model`` logs
    it; models without timm window attention are left alone without a warning. Reached by
    ``timm.create_model``, ``timm.models.create_model``, and ``from timm import
    create_model`` run before or after this call (module-level names; see the module's
    docstring for what is not).
    """
    global _settings, _hook_registered
    settings = _options(patch_kwargs)
    with _lock:
        _settings = settings
        if _TIMM in sys.modules:
            _install()
        elif not _hook_registered:  # fires once, when timm's import completes
            _hook_registered = True
            wrapt.register_post_import_hook(_on_timm_imported, _TIMM)


def unpatch_timm() -> None:
    """Give timm its factory back: every module-level name holding the wrapper holds timm's
    function object again. Models already created stay patched (``unpatch_model``).
    Not counted: one call undoes any number of ``patch_timm`` calls; nothing to undo is no
    error."""
    global _settings
    with _lock:
        _settings = None
        _uninstall()


@contextlib.contextmanager
def patched_timm(**patch_kwargs: Any) -> Iterator[List[CreatedModel]]:
    """``with patched_timm(**patch_kwargs) as created:``: ``patch_timm`` on entry; on exit
    (also on an exception) timm's factory as it was on entry: unpatched, or patched with
    the enclosing arguments when nested. ``created`` lists the models the factory returned
    inside, each with its patch report.

    The scope is the factory's, not the models': a model created inside stays patched after
    the block (``unpatch_model`` or ``patched(model)`` for a model's own scope); only models
    created after it come unpatched."""
    with recording(_lock, _recorders, _settings, patch_timm, unpatch_timm, patch_kwargs) as created:
        yield created


@contextlib.contextmanager
def recording(lock, recorders: List[List[CreatedModel]], previous: Optional[Dict[str, Any]], patch: Callable,
              unpatch: Callable, patch_kwargs: Dict[str, Any]) -> Iterator[List[CreatedModel]]:
    """``patch(**patch_kwargs)`` on entry, a list of the models created inside in
    ``recorders``; on exit (also on an exception) that list removed and the settings
    ``previous`` back: ``unpatch()`` where there were none."""
    with lock:
        patch(**patch_kwargs)
        created: List[CreatedModel] = []
        recorders.append(created)
    try:
        yield created
    finally:
        with lock:
            del recorders[next(i for i, r in enumerate(recorders) if r is created)]  # by identity
            if previous is None:
                unpatch()
            else:
                patch(**previous)
