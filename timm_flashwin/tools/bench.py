"""Whole-model throughput and peak memory, unpatched against patched.

Inference runs the model with its weights in ``dtype`` (eval, no grad); training runs
AMP steps (float32 weights, autocast to ``dtype``, cross-entropy on random labels,
backward, AdamW step). Each timing is the median per-iteration time of up to 5 blocks of
back-to-back iterations (``repeats`` in all, synchronized at the end of each block, as a
plain loop runs them) after ``warmup`` iterations; peak memory is torch's max_memory_allocated
over the warmup and timed iterations (the first, compiling, iteration left out): with CUDA
graphs (torch.compile's reduce-overhead) the warmup iterations record the graphs and
allocate their memory, which replays then reuse without the allocator. GPU only.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..patching.model import patch_model, patch_report
from .tv_models import TV_PREFIX
from .usage import UsageError
from .verify import DTYPES, build_model


@dataclass
class BenchRun:
    variant: str  # "timm", "flashwin" or "flashwin-recompute-qkv[(prefixes)]", with "+compile"
    images_per_s: float
    median_ms: float
    peak_mib: float
    first_iter_s: float  # first call: compilation and autotuning included


@dataclass
class BenchResult:
    model: str
    settings: Dict
    runs: List[BenchRun]
    patched_modules: int

    def speedup(self) -> float:
        by = {r.variant.split("+")[0]: r for r in self.runs}
        return by["flashwin"].images_per_s / by["timm"].images_per_s

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["speedup"] = self.speedup()
        return d


def _step_fn(model: nn.Module, images: torch.Tensor, dtype: torch.dtype, train: bool) -> Callable[[], None]:
    if not train:
        def infer() -> None:
            with torch.inference_mode():
                model(images)
        return infer
    labels = torch.randint(0, 1 << 30, (images.shape[0],), device=images.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=dtype):
            logits = model(images)
        loss = nn.functional.cross_entropy(logits.float(), labels % logits.shape[-1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _measure(variant: str, step: Callable[[], None], warmup: int, repeats: int,
             progress: Optional[Callable[[str, int, int], None]]) -> BenchRun:
    import time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup):
        step()
        if progress:
            progress(variant, i + 1, warmup + repeats)
    torch.cuda.synchronize()
    # steps back to back, as a training loop runs them, synchronized only at the end of a
    # block: a synchronization after every step would add the host's time to the GPU's
    # wherever the host is the bound (the tiny models' training steps)
    times = []
    blocks = min(5, repeats)
    done = warmup
    for b in range(blocks):
        steps = repeats // blocks + (b < repeats % blocks)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / steps)
        done += steps
        if progress:
            progress(variant, done, warmup + repeats)
    median = statistics.median(times)
    return BenchRun(variant, 0.0, median, torch.cuda.max_memory_allocated() / 2 ** 20, first)


def recompute_qkv_option(names: Optional[List[str]]) -> Union[bool, List[str]]:
    """``benchmark_model``'s recompute_qkv from a ``--recompute-qkv [NAME_PREFIX ...]``
    option: absent (None) False, given without names True (every module), else the names."""
    return True if names == [] else names or False


def model_variants(recompute_qkv: Union[bool, str, Sequence[str]] = False) -> Dict[str, Union[bool, Callable]]:
    """The variants ``benchmark_model`` times, label -> patch_model's recompute_qkv for it
    (the unpatched "timm" maps to False too): see its ``recompute_qkv``."""
    variants: Dict[str, Union[bool, Callable]] = {"timm": False, "flashwin": False}
    if recompute_qkv is True:
        variants["flashwin-recompute-qkv"] = True
    elif recompute_qkv:
        prefixes = (recompute_qkv,) if isinstance(recompute_qkv, str) else tuple(recompute_qkv)
        variants[f"flashwin-recompute-qkv({','.join(prefixes)})"] = lambda module, name: name.startswith(prefixes)
    return variants


def benchmark_model(
    name: str,
    *,
    batch: int = 64,
    dtype: str = "bfloat16",
    train: bool = False,
    compile: bool = False,
    compile_mode: Optional[str] = None,
    img_size=None,
    warmup: int = 10,
    repeats: int = 30,
    progress: Optional[Callable[[str, int, int], None]] = None,
    recompute_qkv: Union[bool, str, Sequence[str]] = False,
) -> BenchResult:
    """Images per second and peak memory of ``name``, unpatched then patched.

    compile_mode: torch.compile's ``mode`` (e.g. "reduce-overhead": CUDA graphs, for steps
    whose kernel launches outlast the GPU work), with ``compile``.
    recompute_qkv: also the model patched with ``patch_model(..., recompute_qkv=True)``,
    as a third variant ("flashwin-recompute-qkv"); or a name or names: with recompute_qkv for
    the modules whose qualified names start with one of them ("flashwin-recompute-qkv(names)")."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if compile_mode is not None and not compile:
        raise UsageError(f"compile_mode={compile_mode!r} needs compile=True")
    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA GPU; none is available")
    torch_dtype = DTYPES[dtype]
    base = build_model(name, img_size=img_size)
    cfg = getattr(base, "pretrained_cfg", {}) or {}
    # a torchvision model's input size is its own (its img_size applied: a video model's frames too)
    size = cfg["input_size"][1:] if name.startswith(TV_PREFIX) else img_size or cfg.get("input_size", (3, 224, 224))[1:]
    size = (size, size) if isinstance(size, int) else tuple(size)
    images = torch.randn(batch, 3, *size, device="cuda")
    runs = []
    patched_modules = 0
    for variant, recompute in model_variants(recompute_qkv).items():
        model = copy.deepcopy(base).cuda()
        if variant != "timm":
            patch_model(model, recompute_qkv=recompute)
            patched_modules = len(patch_report(model).patched)
        model.train(train)
        if not train:
            model = model.to(torch_dtype)
        x = images.to(torch_dtype) if not train else images
        if compile:
            torch._dynamo.reset()  # each variant compiles anew, not from the previous one's graphs
            model = torch.compile(model, mode=compile_mode)
        label = variant + (f"+compile({compile_mode})" if compile and compile_mode else "+compile" if compile else "")
        run = _measure(label, _step_fn(model, x, torch_dtype, train), warmup, repeats, progress)
        run.images_per_s = batch / (run.median_ms / 1e3)
        runs.append(run)
        del model
        torch.cuda.empty_cache()
    settings = dict(batch=batch, dtype=dtype, train=train, compile=compile, compile_mode=compile_mode,
                    img_size=list(size), warmup=warmup,
                    repeats=repeats, device=torch.cuda.get_device_name(), torch=torch.__version__)
    return BenchResult(name, settings, runs, patched_modules)
