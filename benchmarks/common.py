"""What the benchmark scripts share."""
import functools
import json
import os
import subprocess
import time
from collections import defaultdict


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """The commit whose code a benchmark ran, "+changes" appended where tracked files differ
    from it, so that every result file says what it measured; "unknown" outside a git
    checkout. Asked once per process (the scripts call it per row): the code a run imported
    at its start is the code it measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` (creating its folder); scripts call it after every
    measurement, so that a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def cuda_kernel_times(prof) -> dict:
    """{kernel name: [launches, GPU us]} summed over the CUDA events of a finished
    torch.profiler run, without the ranges that annotations put on the GPU's timeline
    (``Optimizer.step#AdamW.step`` spans the optimizer's kernels and the gaps between
    them: counted as a kernel, it made a host-bound step's GPU time look longer)."""
    import torch
    kernels = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time_total
    return dict(kernels)


def host_us_per_call(fn, calls: int, warmup: int = 5) -> float:
    """Wall us per call of ``fn`` over ``calls`` back-to-back calls with one synchronization
    at the end: host time where the GPU finishes each call's kernels before the host
    enqueues the next."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def gpu_ms_per_call(fn, calls: int) -> float:
    """GPU ms per call of ``fn`` over ``calls`` back-to-back calls, between two CUDA events."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def timm_meta_mlp(step):
    """``step`` with the SwinV2-CR adapter computing its bias with timm's meta_mlp layers
    (``module._relative_positional_encodings()``), as before ``position_mlp_table`` took
    it: the variant ``flashwin-timm-meta-mlp`` of profile_step.py."""
    from timm_flashwin.patching.adapters import swinv2_cr

    def run():
        fusable = swinv2_cr.fusable_meta_mlp
        swinv2_cr.fusable_meta_mlp = lambda mlp: False
        try:
            step()
        finally:
            swinv2_cr.fusable_meta_mlp = fusable
    return run


def broadcast_query(step):
    """``step`` with GCViT's global blocks handing the op one tensor of queries, keys and
    values, the queries repeated over each image's windows and concatenated beside the
    keys and values (``reference.shared_query_qkv``), as before the kernels read the global
    query from its own tensor: the variant ``flashwin-broadcast-query`` of profile_step.py."""
    from timm_flashwin import window_attention
    from timm_flashwin.patching.adapters import gcvit
    from timm_flashwin.ops.reference import shared_query_qkv

    def attention(self, module, x, bias, q_global, dropout_p, grid=None):
        if q_global is None:
            return shared(self, module, x, bias, q_global, dropout_p, grid)
        kv = module.qkv(x)
        query = q_global.reshape(q_global.shape[0], -1, x.shape[-1]).to(kv.dtype)
        qkv = shared_query_qkv(kv.unflatten(2, (2, module.num_heads, -1)), query, gcvit.query_order() == gcvit.TILED)
        return window_attention(qkv, module.num_heads, bias=bias, dropout_p=dropout_p, **self.score_scale(module))

    shared = gcvit.GcVitAdapter._attention

    def run():
        gcvit.GcVitAdapter._attention = attention
        try:
            step()
        finally:
            gcvit.GcVitAdapter._attention = shared
    return run


def gathered_bias(step):
    """``step`` with the V1 and SwinV2 adapters handing the op their bias gathered
    beforehand (``TableBias.dense()``: a gather of its own, autograd node and kernel launch,
    the attention kernels reading the dense bias), as before the op took a ``TableBias``:
    the variant ``flashwin-gathered-bias`` of profile_step.py and bench_feature_map.py."""
    from timm_flashwin import TableBias
    from timm_flashwin.patching.adapters.swin import SwinAdapter
    from timm_flashwin.patching.adapters.swinv2 import SwinV2Adapter

    def dense(position_bias):
        def gathered(self, module):
            bias = position_bias(self, module)
            return bias.dense() if isinstance(bias, TableBias) else bias
        return gathered

    def run():
        originals = {cls: cls.position_bias for cls in (SwinAdapter, SwinV2Adapter)}
        for cls, position_bias in originals.items():
            cls.position_bias = dense(position_bias)
        try:
            step()
        finally:
            for cls, position_bias in originals.items():
                cls.position_bias = position_bias
    return run


def call_times_us(fn, calls: int, idle: bool) -> list:
    """Host us of each of ``calls`` calls of ``fn``: back to back, or (``idle``) each started
    with the GPU idle (a synchronization and a short sleep before it)."""
    import torch
    times = []
    for _ in range(calls):
        if idle:
            torch.cuda.synchronize()
            time.sleep(0.002)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return times


def enqueue_us(fn, calls: int) -> float:
    """Median host us to enqueue one call of ``fn`` with the GPU idle when it starts: the
    host's own time per call."""
    import statistics
    return statistics.median(call_times_us(fn, calls, idle=True))


def python_profile(fn, calls: int, top: int) -> str:
    """The ``top`` Python functions by own time over ``calls`` back-to-back calls of ``fn``
    (cProfile), as text."""
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
