"""Host programs: an eager op call's forward and backward recorded once per signature and
replayed by C++ (``csrc/host_program.cpp``), with a C++ autograd node.

A host-bound eager training step pays, per attention call, the op's Python (validation
aside: the launch plan's lookups, argument lists, allocations), a
``torch.autograd.Function`` and Triton's launcher, which parses each of some 50 arguments
from Python objects. A call whose signature (every tensor's shape, strides, dtype, device,
alignment and ``requires_grad``, the scalars, the settings the launches depend on) was seen
before instead runs the ATen calls and kernel launches that the first call of that
signature made, in the same order, on this call's tensors:

1. The first call runs the Python road under a ``Recorder`` (``host_recorder.py``): a
   dispatch mode notes each ATen call, ``fast_launch.RECORD`` each launch (the compiled
   kernel, its grid, and every argument as an input or an earlier result, or a constant).
   Its backward, when it runs, is recorded the same way.
2. Once both are recorded, C++ holds them (``native.module().add_signature``) and later
   calls go there. A signature whose first call's graph was dropped unused has its backward
   recorded by a later call.

Both operators take it (``ops.window.window_attention``, ``ops.local``), and calls where
nothing takes a gradient too (``call(..., grad=False)``: the forward alone, no autograd node).

What cannot be recorded keeps the Python road for that signature, for good: a tensor that is
neither an input nor made by the recorded calls (a value cached on a tensor, such as a
mask's region ids), an ATen call that returns no tensors (a value read back to the host),
a launch through Triton's own path (pre-run hooks, launch hooks) or one needing scratch
memory. Where the extension cannot be built (``native``), everything keeps the Python road.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import native
from .host_recorder import NotRecordable, Recorder
from ..kernels import fast_launch
from ..kernels.window import config
from ..kernels.local import plan as local_plan
from ..kernels.arch import IS_HIP, assumed

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- signatures
class _Signature:
    """One signature's state: recorded forward (``forward``: slots, steps, which forward
    slots the backward keeps, the output slot), then its C++ index once the backward is
    recorded; ``failure`` once something could not be."""

    __slots__ = ("forward", "index", "failure")

    def __init__(self):
        self.forward: Optional[Tuple] = None
        self.index: Optional[int] = None
        self.failure: Optional[str] = None


_SIGNATURES: Dict[Tuple, _Signature] = {}
_STATE = threading.local()  # the forward being recorded on this thread: (recorder, signature)


#: whether calls may take host programs at all (benchmarks switch it off to compare; the
#: environment's TIMM_FLASHWIN_HOST_PROGRAMS=0 keeps the extension from being built)
ENABLED = True


@contextlib.contextmanager
def switched_off():
    """Calls made in the block take the Python road (``ENABLED`` off; benchmarks compare the
    two roads, tests take the one that recorded), then the previous setting again."""
    global ENABLED
    previous, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = previous


def available() -> bool:
    """Whether host programs are used in this process: switched on, the extension built, and
    no launch plan overridden (the tuning scripts' ``OVERRIDES``, which no key holds)."""
    return ENABLED and not (config.OVERRIDES or local_plan.OVERRIDES) and native.module() is not None


def takes(tensor: torch.Tensor) -> bool:
    """Whether the op's calls on ``tensor`` take host programs: a CUDA tensor, and host
    programs ``available``."""
    return tensor.is_cuda and not IS_HIP and available()


def tensor_key(t: Optional[torch.Tensor]) -> Optional[Tuple]:
    """What a recorded program depends on of one tensor: its layout, dtype, device,
    16-byte alignment (Triton specializes on it) and whether it takes a gradient."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16


def settings_key() -> Tuple:
    """The process-wide settings the launches depend on."""
    return (torch.are_deterministic_algorithms_enabled(), fast_launch.ENABLED,
            fast_launch._settings_key() if fast_launch.ENABLED else None, assumed())


def with_aliases(key: Tuple, inputs: List[torch.Tensor]) -> Tuple:
    """``key``, told apart where one tensor stands for several inputs (``attend(x, x, x)``):
    a program recorded so reads each of them where the recorder last saw it, which is right
    only for calls that pass the same tensor in the same places."""
    ids = [id(t) for t in inputs]
    if len(set(ids)) == len(ids):
        return key
    return key, tuple(ids.index(i) for i in ids)


def call(key: Tuple, inputs: List[torch.Tensor], python_road: Callable[[], torch.Tensor],
         grad: bool = True) -> torch.Tensor:
    """The op's output for ``inputs`` (the forward's tensors, in a fixed order for ``key``):
    replayed by C++ where the signature's programs are recorded, else ``python_road()``,
    recorded on the signature's first call. ``grad``: whether a gradient follows (the
    forward and backward, with an autograd node), else the forward alone, without one; the
    signature is ``key``, ``grad`` and which inputs are one tensor (``with_aliases``)."""
    key = with_aliases((key, grad), inputs)
    if not grad:
        return _call_without_grad(key, inputs, python_road)
    signature = _SIGNATURES.get(key)
    if signature is not None and signature.index is not None:
        return native.module().apply(signature.index, inputs)
    if signature is None:
        signature = _SIGNATURES[key] = _Signature()
        recorder = Recorder(inputs)
        _STATE.forward = (recorder, signature)
        try:
            with recorder:
                out = python_road()
        except BaseException:  # an error (out of memory) records nothing: a later call records afresh
            del _SIGNATURES[key]
            raise
        finally:
            _STATE.forward = None
            recorder.forget_tensors()
        _note_failure(signature, recorder)
        return out
    if signature.forward is None or signature.failure is not None:
        return python_road()
    # the forward is recorded, its backward not yet (the first call's graph may have been
    # dropped unused): this call's backward may be the one recorded
    _STATE.forward = (None, signature)
    try:
        return python_road()
    finally:
        _STATE.forward = None


def _call_without_grad(key: Tuple, inputs: List[torch.Tensor], python_road: Callable[[], torch.Tensor]
                       ) -> torch.Tensor:
    """``call`` where nothing takes a gradient: the forward alone, replayed without an
    autograd node."""
    signature = _SIGNATURES.get(key)
    if signature is not None and signature.index is not None:
        return native.module().run_forward(signature.index, inputs)
    if signature is not None:
        return python_road()
    signature = _SIGNATURES[key] = _Signature()
    recorder = Recorder(inputs)
    try:
        try:
            with recorder:
                out = python_road()
        except BaseException:  # as in ``call``
            del _SIGNATURES[key]
            raise
        if recorder.failure is None:
            output_slot = recorder.slot(out)
            if recorder.device is None:
                raise NotRecordable("no launch")
            signature.index = native.module().add_signature(
                recorder.num_slots, recorder.steps, 0, [], recorder.device, [], [], output_slot, [], [], [])
    except NotRecordable as error:
        recorder.fail(error)
    finally:
        recorder.forget_tensors()
    _note_failure(signature, recorder)
    return out


def _note_failure(signature: _Signature, recorder: Recorder) -> None:
    """Keeps the signature on the Python road for good where ``recorder`` could not record."""
    if recorder.failure is not None and signature.failure is None:
        signature.failure = recorder.failure
        _log.debug("timm_flashwin host program not recorded: %s", recorder.failure)


def noting_forward() -> bool:
    """Whether the op's forward running now is noted for a host program (``note_forward``):
    recorded, or its backward awaited for recording."""
    return getattr(_STATE, "forward", None) is not None


def note_forward(ctx, saved: Sequence[Optional[torch.Tensor]], kept: Sequence[torch.Tensor],
                 output: torch.Tensor) -> None:
    """Called by the op's autograd.Function forward with what it saves for the backward
    (``ctx.save_for_backward``'s tensors), the other tensors its backward reads (``kept``:
    inputs it keeps as attributes) and its output: while a forward is recorded, completes it;
    and marks ``ctx`` for the backward's recording where the signature awaits one."""
    state = getattr(_STATE, "forward", None)
    if state is None:
        return
    recorder, signature = state
    if recorder is None:  # a later call of a signature whose forward is recorded
        ctx.host_program = signature
        return
    try:
        saved_slots = [recorder.slot(t) if t is not None else -1 for t in saved]
        kept_slots = [recorder.slot(t) for t in kept]
        output_slot = recorder.slot(output)
    except NotRecordable as error:
        recorder.fail(error)
        return
    signature.forward = (recorder, saved_slots, kept_slots, output_slot)
    ctx.host_program = signature


@contextlib.contextmanager
def backward_recording(ctx, known: Sequence[Optional[torch.Tensor]]):
    """Records the backward run in the block (``known``: the saved tensors as unpacked, the
    kept ones, then the output's gradient) where ``ctx``'s forward was recorded; yields a
    function that takes the backward's gradients, one per forward input (None where none;
    the inputs past the last one given take none), to finish it, or None where nothing is
    recorded (the caller then builds no gradient list)."""
    signature = getattr(ctx, "host_program", None)
    if signature is None or signature.index is not None or signature.failure is not None:
        yield None
        return
    recorder = Recorder(known)
    result: Dict[str, Any] = {}
    with recorder:
        yield lambda grads: result.setdefault("grads", grads)
    if recorder.failure is None and "grads" in result:
        try:
            _finish(signature, recorder, known[-1], result["grads"])
        except NotRecordable as error:
            recorder.fail(error)
    _note_failure(signature, recorder)


def _finish(signature: _Signature, backward: Recorder, grad_out: torch.Tensor,
            grads: Sequence[Optional[torch.Tensor]]) -> None:
    forward, saved_slots, kept_slots, output_slot = signature.forward
    if len(grads) > forward.num_inputs:
        raise NotRecordable(f"{len(grads)} gradients for {forward.num_inputs} inputs")
    # the inputs past those given (an index's int32 copy, a mask's region ids) take none
    gradient_slots = [backward.slot(g) if g is not None else -1 for g in grads]
    gradient_slots += [-1] * (forward.num_inputs - len(grads))
    devices = {d for d in (forward.device, backward.device) if d is not None}
    if len(devices) != 1:
        raise NotRecordable("no launch, or launches on two devices")
    # replays hand the backward an aligned gradient in this one's layout (csrc:
    # HostProgramFunction): contiguous for the window operator, and for the local one often
    # q's, (B, S, H, D) in memory, as out.transpose(1, 2).reshape(B, S, H * D) gives it back
    if not _dense(grad_out) or grad_out.data_ptr() % 16:
        raise NotRecordable("the output's gradient was not dense and aligned when recorded")
    signature.index = native.module().add_signature(
        forward.num_slots, forward.steps, backward.num_slots, backward.steps, devices.pop(), saved_slots,
        kept_slots, output_slot, gradient_slots, list(grad_out.shape), list(grad_out.stride()))
    signature.forward = None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory once each (contiguous in some order of its
    dimensions): no gap, no element read twice (an expanded gradient's stride 0)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
