"""The host-program extension (``csrc/host_program.cpp``), built on first use.

``module()`` gives the compiled extension, or None where it cannot be had: no C++ compiler
or ninja (torch.utils.cpp_extension needs both), a failed build, or
``TIMM_FLASHWIN_HOST_PROGRAMS=0`` in the environment. The op then keeps its Python road,
which computes the same. The build takes about a minute once per machine and torch
version (torch's extension cache keeps it, under ``TORCH_EXTENSIONS_DIR``). It happens on
the first eager op call on a GPU, so it is announced on stderr, a line when it starts and
one when it ends, with how to avoid the wait: ``build_extensions()`` ahead of time, or the
environment switch.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from typing import Any, Optional

_log = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "host_program.cpp")
_SWITCH = "TIMM_FLASHWIN_HOST_PROGRAMS"
_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """Whether host programs may be used (the environment switch)."""
    return os.environ.get(_SWITCH, "1") != "0"


def module() -> Optional[Any]:
    """The extension, built or loaded once per process; None where it cannot be."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build() if enabled() else None
    return _state["module"]


def build_extensions() -> bool:
    """Build the host-program extension now (or load torch's cached build), rather than on
    the first eager call on a GPU: in a setup step, a Docker image, before timing anything.

    Returns whether it is available: False where ``TIMM_FLASHWIN_HOST_PROGRAMS=0`` switches
    host programs off or the build is impossible (no C++ compiler or ninja; the reason is
    logged as a warning), and the op's Python road, which computes the same, is used.
    """
    return module() is not None


def _announce(message: str) -> None:
    """One line on stderr: the user sees why the first call stalls, whatever logging says."""
    print(f"timm_flashwin: {message}", file=sys.stderr, flush=True)


def _cached(cpp_extension: Any, name: str) -> bool:
    """Whether torch's extension cache holds a build of ``name`` (loading it takes a moment,
    nothing to announce). Read through a helper private to torch: without it, announce."""
    try:
        directory = cpp_extension._get_build_directory(name, verbose=False)
    except Exception:  # another torch: better one notice too many than a silent minute
        return False
    return os.path.isfile(os.path.join(directory, name + getattr(cpp_extension, "LIB_EXT", ".so")))


def _build() -> Optional[Any]:
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        # the source's hash in the name: torch's cache keeps one build per name, and a build of
        # an older source under the same name was loaded as it was (a changed signature failed)
        with open(_SOURCE, "rb") as source:
            digest = hashlib.sha256(source.read()).hexdigest()[:12]
        name = f"timm_flashwin_host_program_{digest}"
        announce = not _cached(cpp_extension, name)
        if announce:
            _announce(f"building the host-program extension (C++, about a minute, once per machine and torch "
                      f"version); to build it ahead of time: python -c \"import timm_flashwin; "
                      f"timm_flashwin.build_extensions()\"; to switch it off: {_SWITCH}=0")
        start = time.perf_counter()
        extension = cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=["-O2"], verbose=False)
        if announce:
            _announce(f"host-program extension built in {time.perf_counter() - start:.0f} s (kept in torch's "
                      "extension cache)")
        return extension
    except Exception as error:  # no compiler, no ninja, a failed build: the Python road stays
        _log.warning("timm_flashwin: host programs unavailable (%s: %s); the op's Python road is used",
                     type(error).__name__, error)
        return None
