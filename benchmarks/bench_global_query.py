"""GCViT's global attention modules alone: the query read in place by the kernels against the
query repeated and concatenated beside the keys and values (``common.broadcast_query``).

    python benchmarks/bench_global_query.py --batch 64 --out results/global_query.json

One global ``WindowAttentionGlobal`` of each stage of gcvit_tiny (its first), patched, given
the input x (B_, N, C) and q_global (B, Wh, Ww, C) that the module receives in the model at
``--batch`` images; forward and backward under bf16 autocast. Columns: the GPU time of a
forward + backward (the kernels' time under torch.profiler, per call over ``--calls`` calls;
median of ``--rounds`` alternated rounds) and the memory the forward keeps for the backward.
GPU only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import broadcast_query, code_version, write_json  # noqa: E402
from timm_flashwin import patch_model  # noqa: E402


def global_modules(batch: int) -> dict:
    """channels -> (the first global module of that stage, its x, its q_global), from a
    forward of gcvit_tiny on ``batch`` random images; the model patched afterwards."""
    import timm
    from timm.models.gcvit import WindowAttentionGlobal
    torch.manual_seed(0)
    model = timm.create_model("gcvit_tiny").cuda()
    caught = {}

    def hook(module, args, kwargs):
        x, q_global = args[0], args[1] if len(args) > 1 else kwargs.get("q_global")
        if module.use_global and q_global is not None and x.shape[-1] not in caught:
            caught[x.shape[-1]] = (module, x.detach().clone(), q_global.detach().clone())
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
             if isinstance(m, WindowAttentionGlobal)]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(torch.randn(batch, 3, 224, 224, device="cuda"))
    for h in hooks:
        h.remove()
    patch_model(model)
    return caught


def gpu_ms(fn: Callable[[], None], calls: int) -> float:
    """The kernels' time per call of ``fn`` (torch.profiler), after 3 calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / calls / 1e3


def kept_mib(run_forward: Callable[[], None], held: dict) -> float:
    """MiB that ``run_forward`` (which puts its output in ``held``) allocated and that stay
    held while the output and its graph live."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run_forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    held.clear()
    return kept / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for channels, (module, x, q_global) in sorted(global_modules(args.batch).items()):
        x, q_global = x.requires_grad_(), q_global.requires_grad_()

        def forward() -> torch.Tensor:
            with torch.autocast("cuda", torch.bfloat16):
                return module(x, q_global)

        def step() -> None:
            forward().float().sum().backward()

        held = {}

        def kept_forward() -> None:
            held["out"] = forward()
        roads = {"in place": (step, kept_forward), "broadcast": (broadcast_query(step), broadcast_query(kept_forward))}
        times = {name: [] for name in roads}
        for _ in range(args.rounds):
            for name, (fn, _) in roads.items():
                times[name].append(gpu_ms(fn, args.calls))
        kept = {name: kept_mib(run_forward, held) for name, (_, run_forward) in roads.items()}
        row = dict(channels=channels, x=list(x.shape), q_global=list(q_global.shape), heads=module.num_heads,
                   gpu_ms={name: statistics.median(t) for name, t in times.items()}, gpu_ms_rounds=times,
                   kept_mib=kept,
                   device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version())
        rows.append(row)
        print(f"C={channels} x={tuple(x.shape)} heads={module.num_heads}: GPU ms forward + backward "
              + ", ".join(f"{name} {row['gpu_ms'][name]:.3f}" for name in roads)
              + "; kept MiB " + ", ".join(f"{name} {kept[name]:.1f}" for name in roads), flush=True)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
