"""What a GPU allows the kernels: its architecture and limits, read once per device.

The launch plans (``config``, ``plan``, ``local.launch``) are made per signature *and*
architecture: an H100's plans ask for up to 227 KB of shared memory per program, an RTX 4090
has 99 KB, an A100 163 KB, and a plan that does not fit fails at launch (Triton's
OutOfResources) in the user's step. ``device_arch`` answers, for a tensor's device, the
limits the plans must respect; ``TIMM_FLASHWIN_ASSUME_ARCH`` (``sm_80``, ``sm_86``,
``sm_89``, ``sm_90``, ``sm_100``, ``sm_120``, ``sm_75``, ``sm_70``) makes every device
answer that architecture's limits instead: with ``DISABLE_MMA_V3=1`` on an H100/H200, Triton
then builds the very kernels an RTX 4090 or an A100 gets (mma.sync, their tiles and stages).

Below sm_80 the kernels are served where Triton builds them and they fit; elsewhere the op
computes with PyTorch (timm's math) and says so once (``unserved_reason``).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch

#: whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1, set before triton is
#: imported): they then run on CPU tensors, through numpy, with the ``INTERPRETER``'s limits
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: the environment variable that makes plan selection target another architecture's limits
ASSUME_ENV = "TIMM_FLASHWIN_ASSUME_ARCH"
#: a ROCm build of torch (its GPUs are "cuda" devices): the launches that call the CUDA driver
#: themselves (host programs, ``host_program``) step aside there for Triton's own launch
IS_HIP = torch.version.hip is not None


@dataclass(frozen=True)
class Arch:
    """One architecture's limits, as the plans read them.

    name: "sm_86", "gfx942", or "interpreter" (Triton's CPU interpreter: no limits).
    capability: major * 10 + minor on NVIDIA GPUs, 0 elsewhere.
    shared_memory: bytes of shared memory one program may take (the opt-in maximum per
    block: ``shared_memory_per_block_optin``), what Triton checks at launch.
    sm_count: multiprocessors, which the window split targets (``config.target_programs``).
    """

    name: str
    capability: int
    shared_memory: int
    sm_count: int
    backend: str = "cuda"

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"


KB = 1024
#: the limits of each architecture that can be assumed, and that the compile-only build tests
#: check the plans against (CUDA programming guide's per-capability table; SM counts of one
#: common GPU each: V100, T4, A100, RTX 3090, RTX 4090, H100 SXM, B200, RTX 5090)
KNOWN: Dict[str, Arch] = {a.name: a for a in (
    Arch("sm_70", 70, 96 * KB, 80),
    Arch("sm_75", 75, 64 * KB, 40),
    Arch("sm_80", 80, 163 * KB, 108),
    Arch("sm_86", 86, 99 * KB, 82),
    Arch("sm_89", 89, 99 * KB, 128),
    Arch("sm_90", 90, 227 * KB, 132),
    Arch("sm_100", 100, 227 * KB, 148),
    Arch("sm_120", 120, 99 * KB, 170),
)}
#: Triton's CPU interpreter: no shared memory to run out of; the plans keep the sm_90 ones
#: (their interpreter-only tiles aside, ``config._streamed_block``)
INTERPRETER = Arch("interpreter", 0, 227 * KB, 4, backend="interpreter")
#: the oldest NVIDIA architecture the kernels are served on in every dtype (bf16 tensor cores)
MIN_CAPABILITY = 80

_BY_DEVICE: Dict[int, Arch] = {}


def assumed() -> Optional[Arch]:
    """The architecture ``TIMM_FLASHWIN_ASSUME_ARCH`` names, None where it is unset."""
    name = os.environ.get(ASSUME_ENV, "").strip().lower()
    if not name:
        return None
    if not name.startswith("sm_") and name.isdigit():
        name = f"sm_{name}"
    found = KNOWN.get(name)
    if found is None:
        raise ValueError(f"{ASSUME_ENV}={os.environ[ASSUME_ENV]!r}: expected one of {', '.join(KNOWN)}")
    return found


def device_arch(device: torch.device) -> Arch:
    """The limits the plans respect on ``device``: the assumed architecture's where
    ``TIMM_FLASHWIN_ASSUME_ARCH`` is set, else the device's own (read once per device),
    the interpreter's on the CPU (``tensor_arch`` for a tensor's, without a torch.device)."""
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device()
                    if device.type == "cuda" else -1)


def tensor_arch(tensor: torch.Tensor) -> Arch:
    """``device_arch`` of ``tensor``'s device. ``get_device`` gives its CUDA index (-1 on the
    CPU) without building a torch.device: a few us less host time in every eager call of the
    op. Traceable by dynamo (``get_device`` is a constant there, and so is
    ``torch.cuda.get_device_properties``)."""
    return _arch_of(tensor.get_device())


def _arch_of(index: int) -> Arch:
    found = assumed()
    if found is not None:
        return found
    if index < 0:
        return INTERPRETER
    if torch.compiler.is_compiling():
        # dynamo folds the device's properties to constants; a look into _BY_DEVICE would
        # guard the graph on the cache's contents, which the plans, made outside dynamo while
        # the same frame compiles, then change: "Guard failed on the same frame it was
        # created" (H200, torch 2.11, a compiled SwinV2 before any eager call)
        return _read(index)
    found = _BY_DEVICE.get(index)
    if found is None:
        found = _BY_DEVICE[index] = _read(index)
    return found


def _read(index: int) -> Arch:
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 48 * KB
    if torch.version.hip is not None:
        name = getattr(props, "gcnArchName", "gfx").split(":")[0]
        return Arch(name, 0, shared, props.multi_processor_count, backend="hip")
    capability = props.major * 10 + props.minor
    return Arch(f"sm_{capability}", capability, shared, props.multi_processor_count)


def unserved_reason(arch: Arch, dtype: torch.dtype) -> Optional[str]:
    """Why the kernels do not run on ``arch`` for ``dtype`` (None where they do).

    Below sm_80 (T4 and RTX 20xx sm_75, V100 sm_70) Triton 3.8 builds every kernel in every
    dtype (compile-only builds, 2026-11-28), and the plans fit their 64 and 96 KB: float16
    and float32 are served there. bfloat16 products have no tensor cores there and Triton
    builds them on the CUDA cores: never run on such a GPU by this project, so PyTorch's
    math (timm's) computes them. Older GPUs, and backends Triton does not build for, take
    PyTorch's math too."""
    if arch.backend in ("interpreter", "hip"):
        return None
    if arch.backend != "cuda":
        return f"backend {arch.backend} is not served"
    if arch.capability >= MIN_CAPABILITY:
        return None
    if arch.capability < 70:
        return f"{arch.name} is older than Triton's oldest target (sm_70)"
    if dtype == torch.bfloat16:
        return f"{arch.name} has no bfloat16 tensor cores"
    return None


_WARNED: Dict[tuple, bool] = {}


def warn_unserved(arch: Arch, dtype: torch.dtype, reason: str) -> None:
    """Warn once per (architecture, dtype, reason) that PyTorch computes window attention
    there."""
    if (arch.name, dtype, reason) in _WARNED:
        return
    _WARNED[(arch.name, dtype, reason)] = True
    warnings.warn(f"timm_flashwin: {reason}: window attention in {str(dtype).replace('torch.', '')} computes with "
                  f"PyTorch there (timm's math, no speedup)", RuntimeWarning, stacklevel=3)
