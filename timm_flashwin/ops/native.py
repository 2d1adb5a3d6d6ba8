"""The host-program extension (``csrc/host_program.cpp``), built on first use.

``module()`` gives the compiled extension, or None where it cannot be had: no C++ compiler
or ninja (torch.utils.cpp_extension needs both), a failed build, a cache folder that holds
no build and cannot be written, or ``TIMM_FLASHWIN_HOST_PROGRAMS=0`` in the environment.
The op then keeps its Python road, which computes the same; one line on stderr says why
and names the switch.

The build takes about a minute once per machine and torch version; it is kept in a folder
of torch's extension cache (``TORCH_EXTENSIONS_DIR``, else torch's default), under a name
that holds a hash of the source, the torch version and the Python version, so that a
finished build is loaded as it is, without writing anything (torch's own loader takes a
lock file in the folder first): a build made ahead of time (``build_extensions()``) serves a
read-only image or home. It happens on the first eager op call on a GPU, so it is
announced on stderr, a line when it starts and one when it ends.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Optional

_log = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "host_program.cpp")
_SWITCH = "TIMM_FLASHWIN_HOST_PROGRAMS"
_FLAGS = ["-O2"]
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
    """Build the host-program extension now (or load a finished build), rather than on
    the first eager call on a GPU: in a setup step, a Docker image, before timing anything.

    Returns whether it is available: False where ``TIMM_FLASHWIN_HOST_PROGRAMS=0`` switches
    host programs off or the build is impossible (no C++ compiler or ninja, a failed build,
    a cache folder that cannot be written; one line on stderr says which), and the op's
    Python road, which computes the same, is used. A finished build loads from a read-only
    folder.
    """
    return module() is not None


def _announce(message: str) -> None:
    """One line on stderr: the user sees why the first call stalls, whatever logging says."""
    print(f"timm_flashwin: {message}", file=sys.stderr, flush=True)


def _unavailable(reason: str) -> None:
    """Why host programs are off in this process: one line (a warning), with the switch."""
    _log.warning("timm_flashwin: host programs off (%s); the op's Python road computes the same, with more host "
                 "time per call; %s=0 skips this", reason, _SWITCH)


def extension_name() -> str:
    """The build's name: a hash of the source, the flags, torch's and Python's versions (a
    build for another torch is another name, never loaded for this one)."""
    import torch
    with open(_SOURCE, "rb") as source:
        digest = hashlib.sha256(source.read())
    digest.update(f"{_FLAGS} {torch.__version__} {torch.version.git_version} {sys.version_info[:2]}".encode())
    return f"timm_flashwin_host_program_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> str:
    """Where the build of ``name`` lives: TORCH_EXTENSIONS_DIR/NAME, else torch's default
    root, per Python and CUDA version as torch lays it out. Nothing is created."""
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(cpp_extension.get_default_build_root(),
                            f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}")
    return os.path.join(root, name)


def _load_finished(name: str, directory: str) -> Optional[Any]:
    """The finished build in ``directory``, imported as torch imports it, writing nothing;
    None where there is none, or it does not load (a build under way elsewhere: the
    build below waits on torch's lock)."""
    from torch.utils import cpp_extension
    path = os.path.join(directory, name + getattr(cpp_extension, "LIB_EXT", ".so"))
    if not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        extension = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(extension)
        return extension
    except ImportError as error:
        _log.debug("timm_flashwin: the build in %s did not load (%s)", path, error)
        return None


def _writable(directory: str) -> Optional[str]:
    """None where a build can be written in ``directory`` (made if missing), else why not."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    return None


def _cannot_build(directory: str) -> Optional[str]:
    """Why the extension cannot be built here, or None."""
    from torch.utils import cpp_extension
    compiler = getattr(cpp_extension, "get_cxx_compiler", lambda: os.environ.get("CXX", "c++"))()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build their extension"
    if not cpp_extension.is_ninja_available():
        return "no ninja to build their extension (pip install ninja)"
    unwritable = _writable(directory)
    if unwritable is not None:
        return (f"no build of their extension for this torch in {directory}, and it cannot be written there "
                f"({unwritable}); build it ahead of time where it can be (TORCH_EXTENSIONS_DIR=<a writable folder> "
                "python -c \"import timm_flashwin; timm_flashwin.build_extensions()\")")
    return None


def _build() -> Optional[Any]:
    directory = None
    try:
        from torch.utils import cpp_extension
        name = extension_name()
        directory = build_directory(name)
        finished = _load_finished(name, directory)
        if finished is not None:
            return finished
        reason = _cannot_build(directory)
        if reason is not None:
            _unavailable(reason)
            return None
        _announce(f"building the host-program extension (C++, about a minute, once per machine and torch "
                  f"version); to build it ahead of time: python -c \"import timm_flashwin; "
                  f"timm_flashwin.build_extensions()\"; to switch it off: {_SWITCH}=0")
        start = time.perf_counter()
        extension = cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=_FLAGS, build_directory=directory,
                                       verbose=False)
        _announce(f"host-program extension built in {time.perf_counter() - start:.0f} s (kept in {directory})")
        return extension
    except Exception as error:  # a failed build: its log in the folder, one line here
        text = f"{type(error).__name__}: {error}"
        log = _keep_log(text, directory)
        first = text.strip().splitlines()[0][:200]
        _unavailable(f"building their extension failed: {first}" + (f"; the build's output: {log}" if log else ""))
        return None


def _keep_log(text: str, directory: Optional[str]) -> Optional[str]:
    """Writes a failed build's whole output (ninja's log, the compiler's errors) to
    ``directory``/failed_build.log; its path, or None where it cannot be written."""
    if directory is None:
        return None
    try:
        path = os.path.join(directory, "failed_build.log")
        with open(path, "w") as log:
            log.write(text)
        return path
    except OSError:
        return None
