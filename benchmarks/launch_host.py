"""Host time of every Triton kernel launch in a compiled step, by kernel: ours against
inductor's own.

Inductor's generated wrapper launches each Triton kernel through ``CachingAutotuner.run``
(ours too: a ``torch.library.triton_op``'s kernels become user-defined kernels of the
graph). ``launch_host`` times those calls, each kernel apart, over steps that start with the
GPU idle, so that a compiled step whose host time exceeds what its launch count explains
(MaxViT's against its attention-free bound, RESULTS.md) shows which launches take it: the
kernels of ``timm_flashwin.kernels`` (``ours``) or inductor's (``inductor``). Every
autotuner alive in the process is timed (all variants' graphs); the timing wrapper is an
attribute of the instance, removed afterwards. GPU only (``sync`` aside).

    python benchmarks/profile_step.py --model maxvit_tiny_tf_224 --compile --variants flashwin attention-free --launch-host 10
"""
from __future__ import annotations

import collections
import gc
import importlib
import pkgutil
import re
import time
from typing import Callable, Iterable, Optional


def our_kernel_names() -> set:
    """Names of the ``triton.jit`` functions of ``timm_flashwin.kernels`` (``KernelInterface``:
    compiled ``JITFunction`` or, under ``TRITON_INTERPRET=1``, ``InterpretedFunction``)."""
    from triton.runtime.jit import KernelInterface

    import timm_flashwin.kernels as package
    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names.update(value.__name__ for value in vars(module).values() if isinstance(value, KernelInterface))
    return names


def autotuners() -> list:
    """Every inductor ``CachingAutotuner`` alive: one per kernel of every compiled graph."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def is_autotuner(o) -> bool:
        try:
            return isinstance(o, CachingAutotuner)
        except ReferenceError:  # a weak proxy whose object is gone (isinstance asks its class)
            return False
    return [o for o in gc.get_objects() if is_autotuner(o)]


def kernel_name(tuner) -> str:
    """The kernel's name without inductor's numeric suffix
    (``window_attention_fwd_kernel_0`` -> ``window_attention_fwd_kernel``)."""
    name = (getattr(tuner, "inductor_meta", None) or {}).get("kernel_name")
    name = name or getattr(getattr(tuner, "fn", None), "__name__", "?")
    return re.sub(r"_\d+$", "", name)


class LaunchTimer:
    """Within ``with``: each tuner's ``run`` timed, totals[name] = [calls, seconds, arguments,
    tensors] (the last two: what its latest call passed, positional, and how many of them were
    tensors: the launcher's host work grows with them)."""

    def __init__(self, tuners: Iterable):
        self.tuners = [t for t in tuners if "run" not in vars(t)]  # one timer per tuner
        self.totals = collections.defaultdict(lambda: [0, 0.0, 0, 0])

    def _timed(self, run: Callable, name: str) -> Callable:
        entry = self.totals[name]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                entry[0] += 1
                entry[1] += time.perf_counter() - start
                entry[2], entry[3] = len(args), sum(hasattr(a, "data_ptr") for a in args)
        return timed

    def __enter__(self) -> "LaunchTimer":
        for tuner in self.tuners:
            tuner.run = self._timed(tuner.run, kernel_name(tuner))
        return self

    def __exit__(self, *exc) -> None:
        for tuner in self.tuners:
            del tuner.run


def launch_host(step: Callable[[], None], steps: int, sync: Optional[Callable[[], None]] = None,
                tuners: Optional[list] = None, top: int = 12) -> dict:
    """Per step, over ``steps`` steps each started with the GPU idle: for ``ours`` and
    ``inductor``, launches, host us in their ``run`` calls, us per launch, and the ``top``
    kernels by host us as (name, launches, us, arguments, tensors among them)."""
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    ours = our_kernel_names()
    with LaunchTimer(autotuners() if tuners is None else tuners) as timer:
        step()  # a first step through the wrappers, not counted
        sync()
        for entry in timer.totals.values():
            entry[0], entry[1] = 0, 0.0
        for _ in range(steps):
            sync()
            time.sleep(0.002)
            step()
        sync()
    result = {}
    for group in ("ours", "inductor"):
        kernels = [(name, calls / steps, seconds / steps * 1e6, arguments, tensors)
                   for name, (calls, seconds, arguments, tensors) in timer.totals.items()
                   if calls and (name in ours) == (group == "ours")]
        launches = sum(k[1] for k in kernels)
        host_us = sum(k[2] for k in kernels)
        result[group] = dict(launches=launches, host_us=host_us, us_per_launch=host_us / launches if launches else 0.0,
                             kernels=sorted(kernels, key=lambda k: -k[2])[:top])
    return result
