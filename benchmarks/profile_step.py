"""Where one model step spends its time: host against GPU, timm against patched.

    python benchmarks/profile_step.py --model swinv2_cr_tiny_224 --mode train [--compile] --out results/p.json

For each variant (timm, patched), after warm-up: the wall time per step (synchronized),
the host time to enqueue one step (the step call alone, the GPU left to catch up
between steps), and under torch.profiler the GPU kernel time and the number of kernel
launches per step, with the operators that take the most host (self CPU) time and the
kernels that take the most GPU time, and its peak memory as if it ran alone
(``common.peak_mib``). A step whose enqueue time exceeds its GPU time is
bound by the host. GPU only.

The variants are built and warmed up first, then timed in alternating rounds (median
over the rounds): host-bound steps drift with the machine's load, and a block of one
variant after a block of the other would carry that drift into their ratio.
``--inductor NAME=VALUE`` sets a ``torch._inductor.config`` option for the whole run;
the variant ``flashwin-static`` is the patched model compiled with inductor's static
CUDA launcher for user-defined Triton kernels (``static_launch_user_defined_triton_kernels``,
off by default in torch 2.11; compiled anew, not reusing the flashwin variant's graphs), meant
to launch our kernels through torch's launcher instead of Triton's (in torch 2.11 they launch
through it with or without the option: RESULTS.md);
the variant ``flashwin-triton-launch`` is the patched model with every kernel launched
through Triton's ``kernel[grid](...)`` (``kernels.fast_launch`` switched off during its
steps), to measure what the direct launches save in the same process; ``flashwin-partitioned``
is the patched model with timm's roll, partition, merge and roll-back copies around its
modules (``patch_model(..., feature_map=False)``), to measure what reading the windows in
place saves; ``flashwin-gathered-bias`` is the patched model with its V1 and SwinV2 position
biases gathered before the op (``common.gathered_bias``), to measure what reading them from
their tables within the op saves; ``flashwin-timm-meta-mlp`` is the patched model with
SwinV2-CR's bias computed by timm's meta_mlp layers (``common.timm_meta_mlp``), to measure
what ``position_mlp_table`` saves there; ``flashwin-broadcast-query`` is the patched model with
GCViT's global queries repeated over the windows and concatenated beside the keys and values
before the op (``common.broadcast_query``), to measure what reading them from their own tensor
in the kernels saves. ``--loop-vs-idle N`` finds what a step's host
waits on in a loop of steps and not with the GPU idle; ``--launch-host N`` times the host
call of every Triton kernel launch, ours against inductor's (``launch_host.py``). Two
variants bound what any implementation can give: ``attention-free`` (every attention module
computes proj(qkv(x)[..., :C]), nothing between the projections; a tensor the call passes
that takes a gradient gets a zero one) and ``window-free`` (the same on the unpartitioned
feature map, without timm's shift, partition and merge around it).
"""
from __future__ import annotations

import argparse
import ast
import copy
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_models import MODELS  # noqa: E402
from launch_host import launch_host  # noqa: E402
from common import (broadcast_query, call_times_us, code_version, cuda_kernel_times, enqueue_us,  # noqa: E402
                    gathered_bias, peak_mib, python_profile, timm_meta_mlp, write_json)
from timm_flashwin import patch_model  # noqa: E402
from timm_flashwin.patching.adapters import adapter_for  # noqa: E402
from timm_flashwin.tools.bench import _step_fn  # noqa: E402
from timm_flashwin.kernels import fast_launch  # noqa: E402
from timm_flashwin.tools.verify import build_model  # noqa: E402


def _wall_and_enqueue_ms(step, repeats: int):
    """(wall ms per step over ``repeats`` back-to-back steps, median ms to enqueue one step)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / repeats * 1e3
    return wall, enqueue_us(step, repeats) / 1e3


def warm_up(step, steps: int, label: str) -> None:
    """``steps`` steps (the first compiles, under torch.compile), then a line saying how long
    they took: a run cut short by a time limit still says how far it got (compiles take
    minutes)."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(f"{label}: warmed up in {time.perf_counter() - start:.0f} s", flush=True)


def alternating_rounds(steps: dict, rounds: int, repeats: int) -> dict:
    """{variant: (wall ms per round, enqueue ms per round)}: in each round every variant's
    ``_wall_and_enqueue_ms`` back to back, so that a ratio within a round shares the host's
    state of the moment, which drifts between rounds (H200: one variant's wall time read 22
    to 34 ms across 5 rounds of one run)."""
    timings = {variant: ([], []) for variant in steps}
    for _ in range(rounds):
        for variant, step in steps.items():
            wall, enqueue = _wall_and_enqueue_ms(step, repeats)
            timings[variant][0].append(wall)
            timings[variant][1].append(enqueue)
    return timings


def _profile(step, steps: int, top: int):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
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


def _host_self_us(step, steps: int, idle: bool):
    """({host op: (calls, self us) per step}, median ms of one ``step()`` call) under
    torch.profiler over ``steps`` steps: back to back, or (``idle``) each started with the
    GPU idle (``common.call_times_us``, as ``common.enqueue_us`` times them)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        calls = call_times_us(step, steps, idle)
    ops = {e.key: (e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()
           if e.key not in ("cudaDeviceSynchronize", "cudaStreamSynchronize") or not idle}
    return ops, statistics.median(calls) / 1e3


def loop_against_idle(step, steps: int, top: int) -> dict:
    """Where a step's host time goes when steps run back to back (a training loop) and not
    when each starts with the GPU idle (``enqueue_ms``): the ``top`` host ops by the growth
    of their self time per step, each (name, calls per step, us per step in the loop, us
    with the GPU idle, the difference). For steps whose loop runs slower than their enqueue
    time with the GPU faster than both (Hiera's eager patched step, RESULTS.md)."""
    loop, loop_ms = _host_self_us(step, steps, idle=False)
    idle, idle_ms = _host_self_us(step, steps, idle=True)
    ops = [dict(name=name, calls_per_step=loop.get(name, idle.get(name))[0], loop_us=loop.get(name, (0, 0.0))[1],
                idle_us=idle.get(name, (0, 0.0))[1]) for name in set(loop) | set(idle)]
    for op in ops:
        op["extra_us"] = op["loop_us"] - op["idle_us"]
    ops.sort(key=lambda op: -op["extra_us"])
    return dict(loop_step_ms=loop_ms, idle_step_ms=idle_ms, ops=ops[:top])


#: CUDA runtime and ATen calls at which the host may wait for the GPU: a step that makes one
#: cannot run ahead of the GPU, and its host and GPU times add up instead of overlapping
SYNC_POINTS = ("cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize",
               "cudaEventSynchronize", "aten::_local_scalar_dense", "aten::nonzero")


def _sync_points(step, steps: int = 2, frames: int = 6):
    """[(name, calls per step, host us per step, Python stack)] of the calls in
    ``SYNC_POINTS`` over ``steps`` steps, grouped by where in Python they were made."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    found = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.name in SYNC_POINTS:
            where = event
            while where is not None and not where.stack:
                where = where.cpu_parent
            stack = tuple(where.stack[:frames]) if where is not None else ()
            found[(event.name, stack)][0] += 1
            found[(event.name, stack)][1] += event.cpu_time_total
    return [dict(name=name, calls_per_step=c / steps, host_us_per_step=t / steps, stack=list(stack))
            for (name, stack), (c, t) in sorted(found.items(), key=lambda kv: -kv[1][1])]


#: (options of their own also keep dynamo from reusing another variant's graphs: a backend of
#: other options fails its guard; max_autotune False is inductor's default)
VARIANT_INDUCTOR_OPTIONS = {"flashwin-static": dict(static_launch_user_defined_triton_kernels=True),
                            "flashwin-broadcast-query": dict(max_autotune=False)}


def _through_triton(step):
    """``step`` with kernels.fast_launch switched off while it runs."""
    def run():
        fast_launch.ENABLED = False
        try:
            step()
        finally:
            fast_launch.ENABLED = True
    return run


class _KeepsGradient(torch.autograd.Function):
    """``out`` as it is; ``made`` gets a zero gradient, so that the layers that made it run
    their backward as they do when attention reads it."""

    @staticmethod
    def forward(ctx, out, made):
        ctx.made = made.shape, made.dtype, made.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.made
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _attention_free_forward(module, x, *args, **kwargs):
    """proj(the first C channels of qkv(x)): channels last (Swin, AttentionCl, ...), or
    channels first for 1x1-convolution projections (Attention2d); x normalized first where
    the module normalizes its own input (TinyViT's ``norm``). A mask the call passes is not
    read; a tensor that takes a gradient (GCViT's q_global, a shared_rel_pos) is not read
    either, but gets a zero gradient: without it the bound also skipped the backward of the
    layers that make it (GCViT's global-query network, one per stage). A module that pools
    its queries (Hiera's ``q_stride``) returns as many tokens as it has queries."""
    norm = getattr(module, "norm", None)
    if isinstance(norm, torch.nn.Module):
        x = norm(x)
    qkv = module.qkv(x)
    channels_first = isinstance(module.qkv, torch.nn.Conv2d)
    y = qkv[:, :module.proj.in_channels] if channels_first else qkv[..., :module.proj.in_features]
    y = y[:, :y.shape[1] // getattr(module, "q_stride", 1)]
    out = getattr(module, "proj_drop", torch.nn.Identity())(module.proj(y))
    for made in (*args, *kwargs.values()):
        if isinstance(made, torch.Tensor) and made.requires_grad and torch.is_grad_enabled():
            out = _KeepsGradient.apply(out, made)
    return out


def attention_free(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every window-attention module that ``patch_model`` serves given
    ``_attention_free_forward`` as its forward (the ``attention-free`` variant), in place;
    those it leaves to timm keep timm's, as in the patched model."""
    for module in model.modules():
        adapter = adapter_for(module)
        if adapter is not None and adapter.unsupported(module) is None:
            module.forward = types.MethodType(_attention_free_forward, module)
    return model


#: timm's block methods that shift, partition, attend and merge (B, H, W, C) -> (B, H, W, C):
#: SwinTransformerBlock / SwinTransformerV2Block._attn, SwinTransformerV2CrBlock._shifted_window_attn
WINDOW_METHODS = ("_attn", "_shifted_window_attn")


def _window_free_attn(block, x):
    return _attention_free_forward(block.attn, x)


#: timm block class -> its subclass whose window methods are ``_window_free_attn``
_WINDOW_FREE_CLASSES: dict = {}


def window_free(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every block's window path (cyclic shift, pad, partition, attention,
    merge, shift back) replaced by ``_attention_free_forward`` of its attention module on
    the (B, H, W, C) feature map (the ``window-free`` variant), in place: what is left
    if the op also read its windows from, and wrote them back to, the unpartitioned map.

    The blocks get a subclass (as ``patch_model`` swaps classes), not methods set on the
    instances: torch 2.11's dynamo did not guard on those, and in one process the timm and
    window-free variants ran one compiled graph (the same graph hash, launches and GPU time)."""
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, torch.nn.Module) and adapter_for(attn) is not None:
            cls = type(module)
            if cls not in _WINDOW_FREE_CLASSES:
                methods = {name: _window_free_attn for name in WINDOW_METHODS if hasattr(cls, name)}
                _WINDOW_FREE_CLASSES[cls] = type(f"WindowFree{cls.__name__}", (cls,), methods)
            module.__class__ = _WINDOW_FREE_CLASSES[cls]
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="swinv2_cr_tiny_224", choices=list(MODELS))
    parser.add_argument("--mode", default="train", choices=["infer", "train"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default=None)
    parser.add_argument("--repeats", type=int, default=10, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds of the variants")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="NAME=VALUE",
                        help="torch._inductor.config options for the run (Python literals)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--variants", nargs="*", default=["timm", "flashwin"],
                        choices=["timm", "flashwin", "flashwin-partitioned", "flashwin-gathered-bias",
                                 "flashwin-timm-meta-mlp", "flashwin-broadcast-query", "flashwin-static",
                                 "flashwin-triton-launch", "attention-free", "window-free"])
    parser.add_argument("--batch", type=int, default=None, help="default: bench_models.py's for the mode")
    parser.add_argument("--syncs", action="store_true",
                        help="also list the calls at which the host may wait for the GPU, with their Python stacks")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N Python functions with the most own time over 10 steps (cProfile)")
    parser.add_argument("--loop-vs-idle", type=int, default=0, metavar="STEPS",
                        help="also profile STEPS steps back to back and STEPS started with the GPU idle, and list "
                             "the host ops whose self time grows most in the loop")
    parser.add_argument("--launch-host", type=int, default=0, metavar="STEPS",
                        help="also time the host call of every Triton kernel launch over STEPS steps, ours "
                             "against inductor's (launch_host.py; compiled steps)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch._inductor.config as inductor_config
    for option in args.inductor:
        name, _, value = option.partition("=")
        if not hasattr(inductor_config, name):
            parser.error(f"--inductor {option}: torch._inductor.config has no option {name!r}")
        setattr(inductor_config, name, ast.literal_eval(value))
    train = args.mode == "train"
    batch = args.batch or MODELS[args.model][train]
    base = build_model(args.model)
    size = base.pretrained_cfg["input_size"][1:]
    images = torch.randn(batch, 3, *size, device="cuda")
    steps, models = {}, {}
    for variant in args.variants:
        model = copy.deepcopy(base).cuda().train(train)
        if variant == "attention-free":
            attention_free(model)
        elif variant == "window-free":
            window_free(model)
        elif variant == "flashwin-partitioned":
            patch_model(model, feature_map=False)
        elif variant != "timm":
            patch_model(model)
        x = images
        if not train:
            model, x = model.to(torch.bfloat16), images.to(torch.bfloat16)
        if args.compile:
            # the variant's options given to torch.compile too: a backend of other options
            # fails dynamo's backend guard, so that the variant is compiled anew and does not
            # reuse the graphs of an earlier variant of the same class
            options = VARIANT_INDUCTOR_OPTIONS.get(variant)
            model = torch.compile(model, mode=args.compile_mode, options=options)
        steps[variant], models[variant] = _step_fn(model, x, torch.bfloat16, train), model
        if variant == "flashwin-triton-launch":
            steps[variant] = _through_triton(steps[variant])
        elif variant == "flashwin-gathered-bias":
            steps[variant] = gathered_bias(steps[variant])
        elif variant == "flashwin-timm-meta-mlp":
            steps[variant] = timm_meta_mlp(steps[variant])
        elif variant == "flashwin-broadcast-query":
            steps[variant] = broadcast_query(steps[variant])
        # compiled (forward and backward) in the first steps. torch.compile's options patch
        # inductor's config in its compiles only; the patch here also covers what inductor
        # reads from it outside them in these steps (a kernel's launchers made at its first run)
        with inductor_config.patch(VARIANT_INDUCTOR_OPTIONS.get(variant, {})):
            warm_up(steps[variant], 5, variant)
    timings = alternating_rounds(steps, args.rounds, args.repeats)
    rows = []
    for variant, step in steps.items():
        wall, enqueue = (statistics.median(t) for t in timings[variant])
        launches, gpu_ms, host_ops, gpu_kernels = _profile(step, 2, args.top)
        peak = peak_mib(models[variant], step, train)
        row = dict(model=args.model, mode=args.mode, compile=args.compile, compile_mode=args.compile_mode,
                   inductor=args.inductor, variant=variant, batch=batch, wall_ms=wall, enqueue_ms=enqueue,
                   wall_ms_rounds=timings[variant][0], enqueue_ms_rounds=timings[variant][1],
                   gpu_kernel_ms=gpu_ms, launches_per_step=launches, peak_mib=peak, host_ops=host_ops, gpu_kernels=gpu_kernels,
                   device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version())
        if args.syncs:
            row["sync_points"] = _sync_points(step)
        if args.cprofile:
            row["cprofile"] = python_profile(step, 10, args.cprofile)
        if args.loop_vs_idle:
            row["loop_vs_idle"] = loop_against_idle(step, args.loop_vs_idle, args.top)
        if args.launch_host:
            row["launch_host"] = launch_host(step, args.launch_host, top=args.top)
        rows.append(row)
        print(f"{args.model} {args.mode} compile={args.compile} {variant}: wall {wall:.1f} ms, enqueue {enqueue:.1f} ms,"
              f" GPU kernels {gpu_ms:.1f} ms, {launches:.0f} launches per step, peak {peak:.0f} MiB", flush=True)
        for op in host_ops[:15]:
            print(f"    host {op['self_cpu_us_per_step']:9.0f} us {op['calls_per_step']:6.0f}x  {op['name'][:90]}")
        for k in gpu_kernels[:8]:
            print(f"    gpu  {k['us_per_step']:9.0f} us {k['calls_per_step']:6.0f}x  {k['name'][:90]}")
        for sync in row.get("sync_points", []):
            print(f"    sync {sync['host_us_per_step']:9.0f} us {sync['calls_per_step']:6.0f}x  {sync['name']}")
            for frame in sync["stack"]:
                print(f"           {frame[:110]}")
        if args.cprofile:
            print(row["cprofile"])
        if args.loop_vs_idle:
            found = row["loop_vs_idle"]
            print(f"    step call in a loop {found['loop_step_ms']:.1f} ms, with the GPU idle "
                  f"{found['idle_step_ms']:.1f} ms; host ops' growth in the loop:")
            for op in found["ops"]:
                print(f"    loop {op['extra_us']:+9.0f} us {op['calls_per_step']:6.0f}x  {op['name'][:90]}"
                      f"  ({op['loop_us']:.0f} against {op['idle_us']:.0f})")
        for group, found in row.get("launch_host", {}).items():
            print(f"    launches, {group}: {found['launches']:.0f} a step, {found['host_us']:.0f} us of host "
                  f"({found['us_per_launch']:.1f} us each)")
            for name, calls, us, arguments, tensors in found["kernels"][:8]:
                print(f"        {us:9.0f} us {calls:6.0f}x  {arguments:3d} args ({tensors:2d} tensors)  {name[:80]}")
        if args.out:
            write_json(args.out, rows)


if __name__ == "__main__":
    main()
