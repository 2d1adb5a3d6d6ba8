"""``timm-flashwin run``: a Python script or module run as ``python`` runs it, with every
model timm's factory returns patched (``factory.patched_timm``), and every model
transformers' ``from_pretrained`` / ``from_config`` returns (``factory_hf.patched_transformers``).

As ``python SCRIPT ARGS`` / ``python -m MODULE ARGS``: ``sys.argv`` is the script's (its
``[0]`` the script's absolute path, as the ``-m`` form's is the module's file), the code
runs as ``__main__`` (runpy), ``sys.path[0]`` is the script's directory (the current one
for ``-m``), the script's ``sys.exit`` code is the exit code, and an exception the script
raises is printed by ``sys.excepthook`` with the script's frames only, exit code 1.
"""
from __future__ import annotations

import os
import runpy
import sys
import zipfile
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..patching.factory import CreatedModel, patched_timm
from ..patching.factory_hf import patched_transformers

PROG = "timm-flashwin run"
_OWN_FILES = {os.path.normcase(os.path.abspath(f)) for f in (__file__, runpy.__file__)}


@dataclass
class Target:
    """What to run: a script's path, or a module's name (``module=True``), and its arguments."""

    name: str
    module: bool = False
    args: List[str] = field(default_factory=list)


def split_argv(argv: Sequence[str]) -> Tuple[List[str], Optional[Target]]:
    """``run``'s own options (all before the target) and the target: the first argument not
    starting with "-" is the script, ``-m MODULE`` (or ``-mMODULE``) the module; every
    argument after it is the script's."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "-m":
            if i + 1 == len(argv):
                return argv[:i], None
            return argv[:i], Target(argv[i + 1], True, argv[i + 2:])
        if arg.startswith("-m") and not arg.startswith("--"):
            return argv[:i], Target(arg[2:], True, argv[i + 1:])
        if not arg.startswith("-") or arg == "-":
            return argv[:i], Target(arg, False, argv[i + 1:])
    return argv, None


def _script_traceback(tb):
    """The traceback from the first frame that is neither this module's nor runpy's nor
    importlib's: the script's own, as python prints it."""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.normcase(os.path.abspath(filename)) not in _OWN_FILES and not filename.startswith("<frozen"):
            break
        tb = tb.tb_next
    return tb


def _execute(target: Target) -> None:
    """Python's sys.path[0] in place of ours: the script's directory, the current one for
    -m, none for a directory or zip file (runpy puts it first itself); none under -P."""
    saved_argv = sys.argv[:]
    own_path0 = sys.path[0] if sys.path and not getattr(sys.flags, "safe_path", False) else None
    if target.module:
        argv, path0 = ["-m"] + target.args, os.getcwd()  # runpy sets argv[0] to the module's file
    else:
        path = os.path.abspath(target.name)
        argv = [path] + target.args
        path0 = None if os.path.isdir(path) or zipfile.is_zipfile(path) else os.path.dirname(os.path.realpath(path))
    sys.argv = argv
    if own_path0 is not None:
        sys.path[:1] = [path0] if path0 is not None else []
    try:
        if target.module:
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved_argv
        if own_path0 is not None:
            sys.path[:1 if path0 is not None else 0] = [own_path0]


def _print_reports(created: List[CreatedModel], source: str) -> None:
    print(f"timm_flashwin: {source} returned {len(created)} model(s)", file=sys.stderr)
    for model in created:
        print(model, file=sys.stderr)


def run(target: Target, *, report: bool = False, **patch_kwargs) -> int:
    """Run ``target`` with ``patched_timm(**patch_kwargs)`` and
    ``patched_transformers(**patch_kwargs)`` active; its exit code. The
    script's ``SystemExit`` propagates (its code is the exit code, as with python);
    ``report``: each created model's patch report on stderr when the script ends."""
    if not target.module and not os.path.exists(target.name):
        print(f"{PROG}: can't open file {os.path.abspath(target.name)!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        return 2
    created: List[CreatedModel] = []
    created_hf: List[CreatedModel] = []
    try:
        with patched_timm(**patch_kwargs) as created, patched_transformers(**patch_kwargs) as created_hf:
            _execute(target)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the script's: printed as python prints it
        tb = _script_traceback(exc.__traceback__)
        if target.module and tb is None and isinstance(exc, ImportError):
            print(f"{PROG}: {exc}", file=sys.stderr)  # runpy found no such module
        else:
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return 1
    finally:
        if report:
            _print_reports(created, "timm's factory")
            if created_hf:
                _print_reports(created_hf, "transformers' from_pretrained / from_config")
    return 0
