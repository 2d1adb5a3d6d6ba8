"""How the host launches a Triton kernel: ``launcher(kernel)[grid](*args, **kwargs)``.

Two roads. While torch.compile traces a ``torch.library.triton_op`` (and under the
interpreter) the launch goes through ``wrap_triton``, which records it in the graph;
otherwise it is a direct launch on the device of its first tensor (``fast_launch``),
without Triton's per-launch argument binding. ``compiler_options`` and
``launch_options`` give the keyword arguments every launch passes (warps, stages,
register cap, FMA contraction), which differ between the two roads.

Used by the attention kernels' host side (``launch``, ``bias_mask``), the position-bias
and local-attention launchers and the dropout kernel's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple

import torch

from . import fast_launch
from .arch import INTERPRET

if INTERPRET or not hasattr(torch.library, "wrap_triton"):
    # interpreted kernels are plain Python, launched as they are (on CPU tensors); torch
    # before 2.6 has no wrap_triton and launches kernels directly too
    def wrap_triton(kernel):
        return kernel

    def traced_launch() -> bool:
        return False
else:
    from torch.library import wrap_triton
    # whether wrap_triton records launches for tracing (else they run as they are); where
    # a torch cannot say, launches count as traced
    traced_launch = getattr(getattr(torch._library, "triton", None), "is_wrap_triton_enabled", lambda: True)


def launcher(kernel: Any) -> "_Launcher":
    """``launcher(kernel)[grid](*args, **kwargs)``, ``kernel`` a ``@triton.jit`` function: the kernel's launch as ``wrap_triton``
    records it while torch.compile traces (and as the interpreter runs it), else a direct
    launch that skips Triton's per-launch binding where it can (``fast_launch``)."""
    return _Launcher(kernel)


class _Launcher:
    """What ``launcher`` returns: indexed by the grid, the function that launches the kernel."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., Any]:
        if traced_launch():
            return wrap_triton(self.kernel)[grid]
        if INTERPRET:
            return lambda *args, **kwargs: _interpret(self.kernel, grid, args, kwargs)
        return lambda *args, **kwargs: _launch_on_device(self.kernel, grid, args, kwargs)


def _interpret(kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """The interpreter's run of a launch, shown to a host program's recorder where one
    records (``fast_launch.INTERPRETED``): on the CPU a recording then checks each launch's
    tensors as it does on a GPU."""
    wrap_triton(kernel)[grid](*args, **kwargs)
    if fast_launch.RECORD is not None:
        fast_launch.RECORD(kernel, fast_launch.INTERPRETED, grid, args)


def _launch_on_device(kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """A direct launch on the device of the first argument (every launcher's first argument
    is a tensor): Triton launches on the current CUDA device, which a model moved to
    another GPU (``.to("cuda:1")``) does not change. Traced launches get inductor's own
    device guard."""
    device = args[0].device.index
    if device == torch.cuda.current_device():
        fast_launch.launch(kernel, grid, args, kwargs, device)
    else:
        with torch.cuda.device(device):
            fast_launch.launch(kernel, grid, args, kwargs, device)


def unused_pointer(like: torch.Tensor, traced: bool) -> torch.Tensor:
    """The tensor a launch passes for each pointer its kernel does not read (a constexpr turns
    the read off): ``like``, an input of the launch, in a direct launch (no allocation), and
    an empty tensor of its own where torch.compile records the launch (``traced``).
    Inductor prepares every tensor argument of a user kernel on its own, and an input that
    it has not stored as a plain buffer (GCViT's queries, keys and values: a view of a
    concatenation) is copied once per argument it stands in for: six copies of the qkv at
    the window-attention forward's launch, 6 x 147 MiB at GCViT-tiny's first stage, batch
    128 (compiled inference, H100: peak 1.93x timm's)."""
    return like.new_empty((0,)) if traced else like


def compiler_options(num_warps: int = 4) -> dict:
    """Warps and, where the kernel is launched directly, ``enable_fp_fusion=True``: the
    kernels were written and measured with the compiler contracting a multiply and an add
    into one FMA (one instruction per logit fewer in several places; the precision notes
    assume its single rounding), which Triton did by default up to 3.9 and says it will
    not from 3.10 (it warns where a launch leaves the option unset). Traced launches
    (torch.compile) go without it: inductor takes a user kernel's warps and stages only,
    and compiles it with the Triton default."""
    options = dict(num_warps=num_warps)
    if not traced_launch():
        options["enable_fp_fusion"] = True
    return options


class LaunchTiles(Protocol):
    """What ``launch_options`` reads of a launch configuration (``window.config.LaunchConfig``)."""

    num_warps: int
    num_stages: int
    maxnreg: Optional[int]


def launch_options(tiles: LaunchTiles, dropout: bool) -> dict:
    """Warps, stages and, where the kernel is launched directly, the register cap and FMA
    contraction (``compiler_options``).

    A launch traced for torch.compile ends in inductor's own launcher, which takes a user
    kernel's warps and stages but not ``maxnreg`` (torch 2.11 to 2.14: config_to_dict
    drops it), so traced launches go without it: compiled models run those kernels at the
    compiler's register count. Nor with attention dropout: its random numbers keep more
    registers live, and under the cap 0.4 to 2.2 KB per thread would spill (sm_90 build,
    tests/arch_build.py).
    """
    options = dict(compiler_options(tiles.num_warps), num_stages=tiles.num_stages)
    if tiles.maxnreg is not None and not dropout and not traced_launch():
        options["maxnreg"] = tiles.maxnreg
    return options
