"""The host-program extension (``csrc/host_program.cpp``), built on first use.

``module()`` gives the compiled extension, or None where it cannot be had: no C++ compiler
or ninja (torch.utils.cpp_extension needs both), a failed build, or
``TIMM_FLASHWIN_HOST_PROGRAMS=0`` in the environment. The op then keeps its Python road,
which computes the same. The build takes about a minute once per machine and torch
version (torch's extension cache keeps it, under ``TORCH_EXTENSIONS_DIR``); it is logged.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any, Optional

_log = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "host_program.cpp")
_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """Whether host programs may be used (the environment switch)."""
    return os.environ.get("TIMM_FLASHWIN_HOST_PROGRAMS", "1") != "0"


def module() -> Optional[Any]:
    """The extension, built or loaded once per process; None where it cannot be."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build() if enabled() else None
    return _state["module"]


def _build() -> Optional[Any]:
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        _log.info("timm_flashwin: building its host-program extension (once per machine, about a minute)")
        # the source's hash in the name: torch's cache keeps one build per name, and a build of
        # an older source under the same name was loaded as it was (a changed signature failed)
        with open(_SOURCE, "rb") as source:
            digest = hashlib.sha256(source.read()).hexdigest()[:12]
        return cpp_extension.load(name=f"timm_flashwin_host_program_{digest}", sources=[_SOURCE],
                                  extra_cflags=["-O2"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the Python road stays
        _log.warning("timm_flashwin: host programs unavailable (%s: %s); the op's Python road is used",
                     type(error).__name__, error)
        return None
