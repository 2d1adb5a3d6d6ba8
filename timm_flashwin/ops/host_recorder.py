"""The recorder of host programs (``host_program.py``): a dispatch mode that notes each ATen
call of an eager op call, and ``fast_launch.RECORD``'s hook that notes each kernel launch,
every tensor argument as a slot (an input, or an earlier call's result) and every other
argument as a constant, in the form ``csrc/host_program.cpp`` replays."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels import fast_launch


#: kernel parameter kinds, as csrc/host_program.cpp's ParamKind numbers them
PARAM_SLOT, PARAM_NULL, PARAM_I32, PARAM_I64, PARAM_U32, PARAM_U64, PARAM_F32, PARAM_F64 = range(8)
_SCALARS = {"i32": PARAM_I32, "i64": PARAM_I64, "u32": PARAM_U32, "u64": PARAM_U64, "fp32": PARAM_F32,
            "fp64": PARAM_F64}


class NotRecordable(Exception):
    """Something of a call that a program cannot replay; the message says what."""


class Recorder(TorchDispatchMode):
    """Notes the ATen calls and kernel launches made while it is entered, with each tensor
    argument as a slot: ``known`` (the inputs: slots 0, 1, ...; None holds its slot number
    empty) or an earlier call's result."""

    def __init__(self, known: Sequence[Optional[torch.Tensor]]):
        super().__init__()
        self._slots: Dict[int, int] = {}
        self._alive: List[torch.Tensor] = []  # ids stay unique while the recording lasts
        self.num_slots = 0
        self.num_inputs = len(known)
        for tensor in known:
            self._new_slot(tensor)
        self.steps: List[Tuple] = []
        self.failure: Optional[str] = None
        self.device: Optional[int] = None
        self._thread = threading.get_ident()  # launches of other threads are not this call's

    def forget_tensors(self) -> None:
        """Drops the recorded call's tensors (the steps name slots only): a signature whose
        backward is not recorded yet keeps its forward's recorder, not its memory."""
        self._slots.clear()
        self._alive.clear()

    def _new_slot(self, tensor: Optional[torch.Tensor]) -> int:
        slot = self.num_slots
        self.num_slots += 1
        if tensor is not None:
            self._slots[id(tensor)] = slot
            self._alive.append(tensor)
        return slot

    def slot(self, tensor: torch.Tensor) -> int:
        slot = self._slots.get(id(tensor))
        if slot is None:
            raise NotRecordable(f"a tensor {tuple(tensor.shape)} that is neither an input nor made in the call")
        return slot

    def __enter__(self):
        fast_launch.RECORD = self._record_launch
        return super().__enter__()

    def __exit__(self, *exc):
        fast_launch.RECORD = None
        return super().__exit__(*exc)

    def fail(self, error: Exception) -> None:
        """Notes why the call cannot be recorded: the first reason (later ones follow from it)."""
        if self.failure is None:
            self.failure = str(error)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failure is None:
            try:
                self._record_call(func, args, kwargs, out)
            except NotRecordable as error:
                self.fail(error)
        return out

    def _record_call(self, func, args, kwargs, out) -> None:
        schema = func._schema
        values, slots = [], []
        for position, argument in enumerate(schema.arguments):
            if position < len(args) and not argument.kwarg_only:
                value = args[position]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                raise NotRecordable(f"{func}: argument {argument.name} not given")
            if isinstance(value, torch.Tensor):
                values.append(None)
                slots.append(self.slot(value))
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                raise NotRecordable(f"{func}: a list of tensors")
            else:
                values.append(value)
                slots.append(-1)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
            raise NotRecordable(f"{func} returns {type(out).__name__}, not tensors")
        self.steps.append(("call", schema.name, schema.overload_name, values, slots,
                           [self._new_slot(o) for o in outputs]))

    def _record_launch(self, kernel, compiled, grid, args) -> None:
        if self.failure is not None:
            return
        if threading.get_ident() != self._thread:
            self.fail(NotRecordable("another thread launched while the call was recorded"))
            return
        try:
            if compiled is fast_launch.INTERPRETED:  # the CPU tests: no launch to record, known tensors
                for value in args:
                    if isinstance(value, torch.Tensor):
                        self.slot(value)
                return
            self.steps.append(self._launch_step(kernel, compiled, grid, args))
        except NotRecordable as error:
            self.fail(error)

    def _launch_step(self, kernel, compiled, grid, args) -> Tuple:
        if compiled is None:
            raise NotRecordable(f"{kernel.fn.__name__} launched through Triton's own path")
        knobs = getattr(fast_launch, "_knobs", None)
        if knobs is not None and (_hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            raise NotRecordable("Triton launch hooks are set (a profiler's): launches keep Triton's launcher")
        metadata = compiled.metadata
        if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
                or getattr(metadata, "launch_pdl", False) or getattr(metadata, "global_scratch_size", 0)
                or getattr(metadata, "profile_scratch_size", 0) or getattr(metadata, "tensordesc_meta", None)):
            raise NotRecordable(f"{kernel.fn.__name__}: a launch this recorder does not make")
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
        signature = compiled.src.signature
        names = kernel.arg_names
        if any(signature.get(name) != "constexpr" for name in names[len(args):]):
            raise NotRecordable(f"{kernel.fn.__name__}: a runtime parameter passed by keyword")
        params = []
        for name, value in zip(names, args):
            kind = signature[name]
            if kind == "constexpr":
                continue
            if isinstance(kind, str) and kind.startswith("*"):
                if value is None:
                    params.append((PARAM_NULL, 0, 0.0))
                elif isinstance(value, torch.Tensor):
                    params.append((PARAM_SLOT, self.slot(value), 0.0))
                    device = value.device.index
                    if self.device is None:
                        self.device = device
                    elif device != self.device:
                        raise NotRecordable("tensors on two devices")
                else:
                    raise NotRecordable(f"{name}: a pointer given as {type(value).__name__}")
            elif kind in _SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                code = _SCALARS[kind]
                params.append((code, int(value), 0.0) if kind[0] in "iu" else (code, 0, float(value)))
            else:
                raise NotRecordable(f"{name}: parameter type {kind}")
        # the scratch pointers Triton appends (one or two by version; none used: sizes 0)
        params += [(PARAM_NULL, 0, 0.0)] * 2
        grid = tuple(grid) + (1,) * (3 - len(grid))
        return ("launch", int(compiled.function), grid, 32 * metadata.num_warps, int(metadata.shared), params,
                kernel.fn.__name__)  # the name: for the replay's error messages


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a function, or (Triton >= 3.5) a chain of them."""
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None
