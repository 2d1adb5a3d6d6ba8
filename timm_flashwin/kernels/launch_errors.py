"""What a failed kernel launch raises: the errors PyTorch users and their tools expect.

Triton (3.6 to 3.8) reports every CUDA driver error of a module load (``cuModuleLoadData``,
in ``CompiledKernel._init_handles``, at a kernel's first launch on a device) and of a launch
(``cuLaunchKernelEx``) as ``RuntimeError("Triton Error [CUDA]: <the driver's text>")``: out of
memory reads ``Triton Error [CUDA]: out of memory``. Batch-size finders look for
``torch.OutOfMemoryError`` or the text "CUDA out of memory." (accelerate's
``find_executable_batch_size``, Lightning's ``BatchSizeFinder``), so an out-of-memory load
or launch is retried once after ``torch.cuda.empty_cache()`` (the caching allocator often
holds the memory a module load needs) and then raised as ``torch.OutOfMemoryError`` naming
the kernel; any other CUDA error of a launch is raised again with the kernel's name and the
call's tensors. Only the failure path comes here: a launch pays one ``try``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Tuple

import torch

#: how Triton's driver words a CUDA error (backends/nvidia/driver.c, gpuAssert), and the
#: driver's text for CUDA_ERROR_OUT_OF_MEMORY
TRITON_CUDA_ERROR = "Triton Error [CUDA]"
DRIVER_OUT_OF_MEMORY = "out of memory"


def is_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA driver error as Triton raises it."""
    return isinstance(error, RuntimeError) and str(error).startswith(TRITON_CUDA_ERROR)


def is_out_of_memory(error: BaseException) -> bool:
    return is_cuda_error(error) and DRIVER_OUT_OF_MEMORY in str(error)


def kernel_name(kernel: Any) -> str:
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))


def describe_call(kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], device: int) -> str:
    """'the Triton kernel K (grid (a, b, c); tensors (4096, 49, 288) bfloat16, ...) on cuda:0'."""
    seen, tensors = set(), []
    for arg in args:
        if isinstance(arg, torch.Tensor) and id(arg) not in seen:  # unused pointers repeat an input
            seen.add(id(arg))
            tensors.append(f"{tuple(arg.shape)} {str(arg.dtype).replace('torch.', '')}")
    return (f"the Triton kernel {kernel_name(kernel)} (grid {tuple(grid)}; tensors {', '.join(tensors) or 'none'}) "
            f"on cuda:{device}")


def _memory(device: int) -> str:
    """The device's memory, as torch's own out-of-memory message gives it (best effort)."""
    try:
        free, total = torch.cuda.mem_get_info(device)
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        return (f"GPU {device} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; PyTorch holds "
                f"{reserved / 2**30:.2f} GiB ({allocated / 2**30:.2f} GiB allocated)")
    except Exception:  # the device may be past answering
        return f"GPU {device}"


def forget_unloaded(kernel: Any) -> None:
    """Triton sets a compiled kernel's launcher before it loads the module; a load that fails
    (out of memory) leaves the launcher set and no function, and that kernel's next launch
    would call it with a null function. Dropping the launcher makes the next launch load
    the module again (Triton 3.6 to 3.8; another Triton's caches are left alone)."""
    for caches in getattr(kernel, "device_caches", {}).values():
        for compiled in getattr(caches[0], "values", tuple)():
            run = getattr(compiled, "_run", None)
            # a partial: Triton's stored OutOfResources, which every launch raises again
            if getattr(compiled, "module", 0) is None and run is not None and not isinstance(run, functools.partial):
                compiled._run = None


def retry_failed_launch(error: RuntimeError, kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], device: int,
                        again: Callable[[], Any]) -> Any:
    """After ``error`` from a launch of ``kernel``: where it is a CUDA out-of-memory, the
    caching allocator's free blocks are given back and ``again()`` (the launch) runs once
    more, whose result is returned; raises ``torch.OutOfMemoryError`` if that fails too, a
    RuntimeError naming the kernel and the call for any other CUDA error, and ``error`` as
    it is for anything else."""
    if not is_cuda_error(error):
        raise error
    forget_unloaded(kernel)
    if not is_out_of_memory(error):
        raise RuntimeError(f"timm_flashwin: {describe_call(kernel, grid, args, device)} failed: {error}") from error
    torch.cuda.empty_cache()
    try:
        return again()
    except RuntimeError as second:
        forget_unloaded(kernel)
        call = describe_call(kernel, grid, args, device)
        if not is_out_of_memory(second):
            raise RuntimeError(f"timm_flashwin: {call} failed: {second}") from second
        raise torch.OutOfMemoryError(f"CUDA out of memory. timm_flashwin: loading or launching {call} failed "
                                     f"({second}), also after torch.cuda.empty_cache(). {_memory(device)}.") from second
