"""Direct kernel launches with less host time per launch than ``JITFunction.run``.

Eager training steps of the tiny models and of the window-24 base are bound by the host's
launches (benchmarks/RESULTS.md), and every launch through ``kernel[grid](...)`` binds
and specializes its arguments anew: on an H200's host, 29 to 54 us for the forward kernel's
47 arguments (three machine starts), of which calling the compiled kernel takes 10 to 18,
and through here 19 to 31 (bench_launch.py (removed at fc2fe00, in git)).
Here the compiled kernel is kept under a key that holds everything Triton's own cache
key is computed from (each tensor's dtype and 16-byte alignment, each integer's value,
the constexprs and compile options, the device, Triton's debug and instrumentation
settings), and later launches with the same key call it at once. The first launch of
each key goes through ``JITFunction.run``, which compiles (or loads) the kernel. Keys hold
the integers' values (strides, window counts): each new input shape adds a few entries.
Keyword arguments are constexprs and compile options only (hashable values; a tensor
passed by keyword would key the entry by its identity).

Not used under the interpreter (its kernels run as Python) or while a launch is traced
for torch.compile (``launcher.launcher``), and not where a kernel has pre-run hooks or
a Triton without the APIs used here: those take ``JITFunction.run`` as they are.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch

from .launch_errors import retry_failed_launch

try:  # Triton's runtime settings, as JITFunction.run reads them (Triton >= 3.3)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no direct launches
    _knobs = None

#: (kernel, argument key, constexprs and options, device, settings) -> (compiled kernel,
#: the constexprs in the kernel's parameter order after the positional arguments)
_COMPILED: Dict[Tuple, Tuple[Any, Tuple]] = {}

#: whether direct launches are used at all (tests and benchmarks switch it off to compare)
ENABLED = _knobs is not None

#: called after each launch with (kernel, compiled kernel or None, grid, args) while a host
#: program is recorded (``timm_flashwin.ops.host_program``); None otherwise
RECORD = None

#: what RECORD is given for the compiled kernel of a launch the interpreter ran
#: (``TRITON_INTERPRET=1``, the CPU tests): nothing to record, but its tensors are checked
INTERPRETED = object()


def _arguments_key(args: Sequence) -> Tuple:
    """What Triton specializes the runtime arguments on, or more: each integer's value
    (Triton: its width, its divisibility by 16), a tensor's dtype and whether its address
    is a multiple of 16, floats by type alone (never specialized), other values (bool,
    Triton's i1 where 1 is an i32; None) by type and value. One comprehension, no call
    per argument: this runs at every launch."""
    return tuple([arg if type(arg) is int
                  else float if type(arg) is float
                  else (arg.dtype, arg.data_ptr() % 16 == 0) if isinstance(arg, torch.Tensor)
                  else (type(arg), arg) for arg in args])


def _settings_key() -> Tuple:
    return _knobs.runtime.debug, _knobs.compilation.instrumentation_mode


def launch(kernel, grid: Tuple[int, ...], args: Sequence, kwargs: Dict[str, Any], device: int) -> None:
    """``kernel[grid](*args, **kwargs)``: positional runtime arguments, keyword constexprs and
    compile options (``num_warps``, ...), as the launchers in ``launch.py`` call kernels;
    ``device`` is the current CUDA device, on which Triton launches (the caller has it).
    A CUDA error of the load or the launch is raised as ``launch_errors`` says (an out of
    memory retried once, then ``torch.OutOfMemoryError``)."""
    if not ENABLED or getattr(kernel, "pre_run_hooks", None):
        try:
            kernel[grid](*args, **kwargs)
        except RuntimeError as error:
            retry_failed_launch(error, kernel, grid, args, device, lambda: kernel[grid](*args, **kwargs))
        if RECORD is not None:
            RECORD(kernel, None, grid, args)  # not recordable
        return
    key = (kernel, _arguments_key(args), tuple(kwargs.items()), device, _settings_key())
    entry = _COMPILED.get(key)
    if entry is None:
        def first_launch():  # compiles (or loads) the kernel and launches it
            return _keep(key, kernel, kernel.run(*args, grid=grid, warmup=False, **kwargs), len(args), kwargs)
        try:
            compiled = first_launch()
        except RuntimeError as error:
            compiled = retry_failed_launch(error, kernel, grid, args, device, first_launch)
    else:
        compiled, constexprs = entry
        try:
            compiled[(*grid, 1, 1)[:3]](*args, *constexprs)  # the compiled kernel's launcher takes 3 grid sizes
        except RuntimeError as error:
            retry_failed_launch(error, kernel, grid, args, device,
                                lambda: compiled[(*grid, 1, 1)[:3]](*args, *constexprs))
    if RECORD is not None:
        RECORD(kernel, compiled, grid, args)


def _keep(key: Tuple, kernel, compiled, num_positional: int, kwargs: Dict[str, Any]) -> Any:
    """Keeps the compiled kernel for later launches of ``key`` where it can; returns it."""
    if hasattr(compiled, "result"):  # an asynchronous compilation's future
        compiled = compiled.result()
    names = kernel.arg_names[num_positional:]
    # a parameter left to its default, or a Triton whose compiled kernels launch otherwise:
    # every launch of this key goes through Triton
    if hasattr(type(compiled), "__getitem__") and all(name in kwargs for name in names):
        _COMPILED[key] = compiled, tuple(kwargs[name] for name in names)
    return compiled


def clear() -> None:
    """Forget the compiled kernels (they stay in Triton's own caches)."""
    _COMPILED.clear()
