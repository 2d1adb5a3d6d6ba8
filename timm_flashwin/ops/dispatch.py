"""How a call reaches the kernels: registered operators, or, in eager mode, the kernels
launched directly.

Every public function of this package has two roads to its Triton kernels. Under
torch.compile, a dispatch mode (FakeTensorMode, selective checkpointing, ...) or for a
tensor subclass, it calls operators registered with ``torch.library`` (``register_op``),
which those can see and trace. In plain eager mode on plain tensors (``dispatch_free``)
it skips that dispatch and launches the kernels itself (``direct_launches``): eager
training steps of the tiny models are bound by host time (benchmarks/RESULTS.md). Tensors
the kernels do not take (``uses_kernels``: plain CPU tensors, float64) take PyTorch's
expressions instead. Under torch.func's transforms (grad, vjp, vmap) the operators are
called through an ``autograd.Function`` each (``call_operator``), which torch.func takes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch

from ..kernels.arch import INTERPRET, Arch, tensor_arch, unserved_reason, warn_unserved
from ..kernels.budget import keeps_tuned

#: the dtypes the kernels take; float64 runs in PyTorch
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the torch.library namespace of the registered operators
NAMESPACE = "timm_flashwin"
#: Tensor types that dispatch as plain tensors: nn.Parameter disables __torch_function__
#: (a Swin V1 bias table is one; taking it for a subclass sent every eager call of the
#: bias gather through the operator dispatch: 0.75 ms of host time per layer and training
#: step of swin_tiny on an H100, bench_host.py (removed at fc2fe00, in git) --profile).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_set_wrap_triton_enabled = getattr(getattr(torch._library, "triton", None), "set_wrap_triton_enabled", None)
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
#: the module holding the flag torch.export sets (strict and non-strict, torch 2.6+)
_compiler_module = torch.compiler if hasattr(torch.compiler, "_is_exporting_flag") else None


#: registered operator -> the autograd.Function that runs it under torch.func's transforms
_FOR_TRANSFORMS: Dict[object, type] = {}


def register_op(name: str, impl, fake):
    """``NAMESPACE::name`` running ``impl``. triton_op lets torch.compile see the Triton
    kernels; the interpreter's kernels are plain Python functions that cannot be traced,
    so there (and on torch < 2.6) the op is an opaque custom_op with an explicit fake.
    Call it through ``call_operator``, which torch.func's transforms take."""
    qualname = f"{NAMESPACE}::{name}"
    if hasattr(torch.library, "triton_op") and not INTERPRET:
        op = torch.library.triton_op(qualname, impl, mutates_args=())
    else:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(fake)
    _FOR_TRANSFORMS[op] = _function_for_transforms(op, None, None)
    return op


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """Registers ``op``'s autograd, and the same ``backward`` and ``setup_context`` as the
    ``autograd.Function`` that ``call_operator`` takes under torch.func's transforms."""
    op.register_autograd(backward, setup_context=setup_context)
    _FOR_TRANSFORMS[op] = _function_for_transforms(op, backward, setup_context)


def _function_for_transforms(op, backward: Optional[Callable], setup_context: Optional[Callable]) -> type:
    """An ``autograd.Function`` running ``op`` (``backward`` None: it takes no gradient).
    The autograd torch.library generates for a custom operator has no ``setup_context``,
    and torch.func's transforms refuse it (``grad``, ``vjp``, ``jacrev``; torch 2.11 to
    2.14), also for an operator called in another's backward, which is why every registered
    operator has one. ``generate_vmap_rule``: ``vmap`` runs ``op`` once per element (it has
    no batching rule), so ``vmap(grad(...))`` gives per-sample gradients."""
    name = op._opoverload._opname

    def no_backward(ctx, *grads):
        raise RuntimeError(f"{NAMESPACE}::{name} is not differentiable (a backward's operator: no second derivative)")

    class ForTransforms(torch.autograd.Function):
        generate_vmap_rule = True
        # the arguments a call leaves out: its setup_context reads them all
        defaults = tuple(a.default_value if a.has_default_value() else None for a in op._opoverload._schema.arguments)

        @staticmethod
        def forward(*inputs):
            return op(*inputs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            if setup_context is not None:
                setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            return (backward or no_backward)(ctx, *grads)

    ForTransforms.__name__ = ForTransforms.__qualname__ = f"{name}_for_transforms"
    return ForTransforms


def call_operator(op, *inputs):
    """``op(*inputs)`` (a ``register_op`` operator); under a torch.func transform through its
    ``autograd.Function`` (``_function_for_transforms``)."""
    function = _FOR_TRANSFORMS.get(op) if _functorch_transforms_active() else None
    if function is None:
        return op(*inputs)
    return function.apply(*inputs, *function.defaults[len(inputs):])


def direct_launches():
    """Launch the kernels as they are, not through wrap_triton's higher-order op, which
    only tracing needs (a triton_op's eager call does the same). Measured on an H100
    (bench_host.py (removed at fc2fe00, in git)): left on, a patched swin_tiny attention module's forward
    took 780 to 920 us of host time, against 270 to 360 us through the operator."""
    return _set_wrap_triton_enabled(False) if _set_wrap_triton_enabled is not None else contextlib.nullcontext()


def no_dispatch_mode() -> bool:
    """Whether this is plain eager mode: no torch.compile or torch.jit tracing, no torch.func
    transform (grad, vmap, ...: the eager path's autograd.Function takes none) and no
    dispatch mode (FakeTensorMode, ...) in effect. Only then is a value computed outside the
    operators real and may be kept for later calls (under FakeTensorMode a kept index view
    or window map would be a fake tensor, which later eager calls would read)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _functorch_transforms_active():
        return False
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return dispatch_modes is not None and dispatch_modes() == 0


def exporting() -> bool:
    """torch.export is tracing (strict or not): a module's index buffers are fake tensors,
    whose values cannot be read when the graph is made (``TableBias.constant_index``).

    Reads the flag torch.export sets rather than calling ``torch.compiler.is_exporting()``:
    dynamo up to torch 2.11 answers True for that call under torch.compile too
    (pytorch#176347), which sent every compiled patched model down the export road: a
    compiled SwinV2-tiny training step sorted each block's position-bias pairs and built
    its window maps in the graph at every step (12 sorts, 24 aranges, 36 copies; 0.4 ms
    of GPU time and about 100 launches per step, H200, torch 2.11)."""
    if _compiler_module is not None:
        return _compiler_module._is_exporting_flag
    return _is_exporting()


def dispatch_free(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` can skip the operator dispatch: eager mode
    (``no_dispatch_mode``) on a plain tensor (or parameter)."""
    if _set_wrap_triton_enabled is None and hasattr(torch.library, "wrap_triton"):
        return False  # a torch whose wrap_triton cannot be switched off
    return type(tensor) in PLAIN_TENSOR_TYPES and no_dispatch_mode()


def uses_kernels(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor (else PyTorch computes)."""
    if tensor.dtype not in KERNEL_DTYPES:
        return False
    # is_cuda, not device.type: no torch.device built per call (host time of eager calls)
    return tensor.is_cuda or (INTERPRET and tensor.device.type == "cpu")


def served(arch: Arch, dtype: torch.dtype, misfit: Callable[[], Optional[str]]) -> bool:
    """Whether the kernels run a call on ``arch`` (``uses_kernels`` says whether they take its
    tensors at all): the architecture builds them for ``dtype`` (``arch.unserved_reason``)
    and ``misfit()`` is None, else the call's shape in words, whose plans do not fit the
    architecture's shared memory. Hopper's and Blackwell's tuned plans serve every call
    (asked nothing: this runs in every eager call). Elsewhere PyTorch computes the call, and
    a warning says so once."""
    if keeps_tuned(arch):
        return True
    reason = unserved_reason(arch, dtype)
    if reason is None:
        shape = misfit()
        if shape is None:
            return True
        reason = f"{shape} needs more shared memory than {arch.name}'s {arch.shared_memory // 1024} KB"
    if not torch.compiler.is_compiling():
        warn_unserved(arch, dtype, reason)
    return False


def unserved_device(model: torch.nn.Module) -> Optional[str]:
    """Why the kernels do not serve ``model`` on the device its parameters are on, in their
    dtype (``arch.unserved_reason``: bfloat16 on a T4), None where they do or it has none
    (``patch_model`` then leaves its modules on their own forward)."""
    param = next(model.parameters(), None)
    reason = unserved_reason(tensor_arch(param), param.dtype) if param is not None else None
    return f"{reason}: {str(param.dtype).replace('torch.', '')} computes with PyTorch there" if reason else None


#: what computes the operators' calls ("road"), in words for reports and examples
ROADS = {"triton": "the Triton kernels",
         "triton-interpreter": "the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1: slow)",
         "pytorch": "PyTorch's math (the same results, no speedup; the kernels run on a CUDA GPU, or on a CPU with "
                    "TRITON_INTERPRET=1)"}


def road(device: torch.device, dtype: torch.dtype) -> str:
    """What computes calls on tensors of ``device`` and ``dtype`` (a key of ``ROADS``):
    "triton" on a GPU the kernels serve in that dtype, "triton-interpreter" on a CPU under
    ``TRITON_INTERPRET=1``, else "pytorch" (CPU tensors, float64, a GPU that the kernels do
    not serve in that dtype: ``arch.unserved_reason``)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if not uses_kernels(probe):
        return "pytorch"
    if not probe.is_cuda:
        return "triton-interpreter"
    return "pytorch" if unserved_reason(tensor_arch(probe), dtype) is not None else "triton"


def road_name(device: torch.device, dtype: torch.dtype) -> str:
    """``ROADS[road(device, dtype)]``: what computes there, in words."""
    return ROADS[road(device, dtype)]


def model_road(model: torch.nn.Module) -> Optional[str]:
    """``road`` of the device and dtype of ``model``'s parameters (None: it has none)."""
    param = next(model.parameters(), None)
    return road(param.device, param.dtype) if param is not None else None

