"""What the benchmark scripts share: the environment header, raw JSON files under
benchmarks/results/, and the timing of steps (host time, GPU time, alternating rounds)."""
import functools
import json
import os
import re
import statistics
import subprocess
import time
from collections import defaultdict

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """The commit whose code a benchmark ran, "+changes" appended where tracked files differ
    from it; "unknown" outside a git checkout. Asked once per process: the code a run
    imported at its start is the code it measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


@functools.lru_cache(maxsize=None)
def environment() -> dict:
    """Device, driver, versions, date and code of this run: every result row carries it."""
    import torch
    env = dict(device="cpu", driver="-", torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               code=code_version())
    for name in ("triton", "timm", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True).stdout.split("\n")[0].strip() or "-"
        except OSError:
            pass
    return env


def header() -> str:
    """One line: what RESULTS.md states above each table."""
    env = environment()
    return "# " + "  ".join(f"{k} {v}" for k, v in env.items())


def default_out(prefix: str) -> str:
    """benchmarks/results/<prefix>_<gpu>_<commit>.json, e.g. train_h100_3fe5554.json."""
    gpu = re.search(r"[A-Z]\d{2,4}", environment()["device"])
    return os.path.join(RESULTS, f"{prefix}_{gpu.group(0).lower() if gpu else 'cpu'}_{code_version()}.json")


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` (creating its folder); scripts call it after every
    measurement, so that a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def cuda_kernel_times(prof) -> dict:
    """{kernel name: [launches, GPU us]} over the CUDA events of a finished torch.profiler
    run, without the ranges annotations put on the GPU's timeline (``Optimizer.step#AdamW.step``
    spans the optimizer's kernels and the gaps between them)."""
    import torch
    kernels = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time_total
    return dict(kernels)


def profile(step, steps: int, top: int):
    """(launches per step, GPU kernel ms per step, the ``top`` host ops by self time, the
    ``top`` kernels by GPU time) of ``steps`` steps under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = cuda_kernel_times(prof)
    launches = sum(c for c, _ in kernels.values()) / steps
    gpu_ms = sum(t for _, t in kernels.values()) / steps / 1e3
    by_gpu = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    host_ops = [dict(name=e.key, calls_per_step=e.count / steps, self_cpu_us_per_step=e.self_cpu_time_total / steps)
                for e in ops]
    gpu_kernels = [dict(name=name[:120], calls_per_step=c / steps, us_per_step=t / steps) for name, (c, t) in by_gpu]
    return launches, gpu_ms, host_ops, gpu_kernels


def host_us_per_call(fn, calls: int, warmup: int = 5) -> float:
    """Wall us per call over ``calls`` back-to-back calls, one synchronization at the end:
    what a plain loop pays per call where the host is the bound."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def enqueue_us(fn, calls: int) -> float:
    """Median host us of one call of ``fn`` started with the GPU idle (a synchronization and
    a short sleep before it): the host's own time per call."""
    import torch
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        time.sleep(0.002)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def warm_up(step, steps: int, label: str) -> None:
    """``steps`` steps (the first compiles), then a line saying how long they took: a run
    cut short by a time limit still says how far it got."""
    import torch
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(f"{label}: warmed up in {time.perf_counter() - start:.0f} s", flush=True)


def alternating_rounds(steps: dict, rounds: int, repeats: int) -> dict:
    """{variant: (wall ms per round, enqueue ms per round)}: in each round every variant's
    ``repeats`` steps back to back (wall: synchronized at the end) and its median enqueue
    time, so that a ratio within a round shares the host's state of the moment, which
    drifts between rounds (H200: one variant read 22 to 34 ms across 5 rounds of one run)."""
    import torch
    timings = {variant: ([], []) for variant in steps}
    for _ in range(rounds):
        for variant, step in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                step()
            torch.cuda.synchronize()
            timings[variant][0].append((time.perf_counter() - t0) / repeats * 1e3)
            timings[variant][1].append(enqueue_us(step, repeats) / 1e3)
    return timings


def python_profile(fn, calls: int, top: int) -> str:
    """The ``top`` Python functions by own time over ``calls`` calls of ``fn`` (cProfile)."""
    import cProfile
    import io
    import pstats

    import torch
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def peak_mib(model, step, train: bool, steps: int = 3) -> float:
    """A variant's peak memory as if it ran alone, MiB: the allocator's peak during ``steps``
    steps, less what was allocated before them (every variant of a run stays resident),
    plus the model's parameters, and in training AdamW's two moments of each."""
    import torch
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    state = (3 if train else 1) * sum(p.numel() * p.element_size() for p in model.parameters())
    return (torch.cuda.max_memory_allocated() - before + state) / 2 ** 20
