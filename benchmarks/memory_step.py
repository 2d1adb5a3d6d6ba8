"""Where a step's memory goes, timm against patched: a training step's saved activations,
the peaks of its forward and backward and the saved tensors grouped by shape; for any step,
the blocks allocated at its peak and the lines that allocated them.

    python benchmarks/memory_step.py --model swin_tiny_patch4_window7_224 --batch 128 --compile \
        [--top 25] [--out results/memory_step.json]
    python benchmarks/memory_step.py --model gcvit_tiny --mode infer --compile

One AMP bf16 training step as bench_train.py runs it (forward, cross-entropy, backward,
AdamW), split into its phases on a synchronized GPU, after warm-up steps (which compile).
Columns per variant, MiB above what was allocated before the step (the parameters, AdamW's
moments, the other variant):

* ``saved``: allocated after the forward (the activations autograd keeps, and the loss).
* ``fwd peak`` / ``bwd peak``: the allocator's peak during the forward / the backward
  (``bwd peak`` holds the parameters' gradients, allocated as the backward goes).
* ``saved by the graph``: the bytes of the distinct storages the autograd graph keeps
  (``saved_tensors``), grouped by shape and dtype.

The rows where the two variants' saved tensors differ say what the patched model keeps
that timm does not, and the reverse. ``--mode infer``: bf16 weights under
torch.inference_mode, as bench_models.py runs inference. Both modes then list the blocks
alive at the step's peak (the allocator's trace of one step replayed), grouped by the first
two frames of model, library or inductor-generated code that allocated them, with their
source lines: under torch.compile, the generated code's buffer. GPU only.
"""
from __future__ import annotations

import argparse
import collections
import copy
import linecache
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, write_json  # noqa: E402
from timm_flashwin import patch_model  # noqa: E402
from timm_flashwin.tools.verify import build_model  # noqa: E402

MIB = 2 ** 20


def saved_tensors(loss: torch.Tensor) -> dict:
    """'(shape) dtype' -> [count, MiB] of the distinct CUDA storages that the autograd graph
    behind ``loss`` keeps for its backward (a view and its base count once): each built-in
    node's ``_saved_*`` tensors and each Python function's ``saved_tensors`` (under
    torch.compile, the compiled graph's node: what its partitioner keeps)."""
    storages, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # freed, or not a tensor
                    continue
                tensors += [v for v in (value if isinstance(value, (tuple, list)) else (value,))
                            if isinstance(v, torch.Tensor)]
        if hasattr(node, "saved_tensors"):
            try:
                tensors += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
            except RuntimeError:
                pass
        for tensor in tensors:
            if tensor.device.type == "cuda":
                storage = tensor.untyped_storage()
                storages.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(tensor.shape), tensor.dtype))
        stack.extend(next_node for next_node, _ in node.next_functions)
    groups = collections.defaultdict(lambda: [0, 0.0])
    for nbytes, shape, dtype in storages.values():
        key = f"{shape} {str(dtype).replace('torch.', '')}"
        groups[key][0] += 1
        groups[key][1] += nbytes / MIB
    return dict(groups)


def _frame_label(frames: list) -> str:
    """The first two frames of model, library or inductor-generated code, with their lines."""
    mine = [f for f in frames if any(part in f["filename"] for part in ("torchinductor", "timm", "flashwin"))
            and not f["filename"].endswith("module.py")][:2]
    return " | ".join(f"{os.path.basename(f['filename'])}:{f['line']} "
                      f"{linecache.getline(f['filename'], f['line']).strip()[:100]}" for f in mine) or "?"


def allocations_at_peak(step) -> dict:
    """Run ``step`` once with the allocator's history recorded; replay its trace and return
    {"peak_mib": the most allocated above the start, "blocks": [[MiB, count, label], ...]} of
    the blocks alive then, largest first (``_frame_label``)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups = collections.defaultdict(lambda: [0.0, 0])
    for size, frames in at_peak.values():
        group = groups[_frame_label(frames)]
        group[0] += size / MIB
        group[1] += 1
    return dict(peak_mib=peak / MIB,
                blocks=sorted(([mib, n, label] for label, (mib, n) in groups.items()), reverse=True))


def _phases(model, images, labels, opt, record: bool) -> dict:
    sync = torch.cuda.synchronize
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(images)
    loss = F.cross_entropy(logits.float(), labels % logits.shape[-1])
    kept = saved_tensors(loss) if record else None
    sync()
    after_forward = torch.cuda.memory_allocated()
    forward_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    sync()
    backward_peak = torch.cuda.max_memory_allocated()
    del logits, loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return dict(saved_mib=(after_forward - before) / MIB, forward_peak_mib=(forward_peak - before) / MIB,
                backward_peak_mib=(backward_peak - before) / MIB,
                saved_tensors=kept)


def _step(model, images, labels, train: bool):
    """One training step (``_phases``; ``record=True`` also walks the graph it keeps) or one
    inference step under torch.inference_mode."""
    if not train:
        def infer(record: bool = False) -> None:
            with torch.inference_mode():
                model(images)
        return infer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda record=False: _phases(model, images, labels, opt, record)


def run(name: str, batch: int, compile_mode, warmup: int, train: bool) -> dict:
    base = build_model(name)
    size = base.pretrained_cfg["input_size"][1:]
    images = torch.randn(batch, 3, *size, device="cuda", dtype=torch.float32 if train else torch.bfloat16)
    labels = torch.randint(0, 1 << 30, (batch,), device="cuda")
    results = {}
    for variant in ("timm", "flashwin"):
        model = copy.deepcopy(base).cuda().train(train)
        if not train:
            model = model.to(torch.bfloat16)
        if variant == "flashwin":
            patch_model(model)
        runnable = model if compile_mode is None else torch.compile(model, mode=compile_mode)
        step = _step(runnable, images, labels, train)
        for _ in range(warmup):
            step()
        results[variant] = step(record=True) if train else {}
        results[variant]["at_peak"] = allocations_at_peak(step)
        del model, runnable, step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


def report_peaks(results: dict, top: int) -> None:
    for variant, row in results.items():
        at_peak = row["at_peak"]
        print(f"\n{variant}: {at_peak['peak_mib']:.1f} MiB allocated above the step's start at its peak; the blocks "
              f"alive then, by the code that allocated them:")
        for mib, count, label in at_peak["blocks"][:top]:
            print(f"  {mib:9.1f} MiB {count:4d} x  {label}")


def report(results: dict, top: int) -> None:
    timm, ours = results["timm"], results["flashwin"]
    print(f"{'MiB':24s} {'timm':>9s} {'patched':>9s} {'ratio':>6s}")
    for key, label in (("saved_mib", "saved"), ("forward_peak_mib", "fwd peak"), ("backward_peak_mib", "bwd peak")):
        a, b = timm[key], ours[key]
        print(f"{label:24s} {a:9.1f} {b:9.1f} {b / a if a else float('nan'):6.2f}")
    total = {v: sum(mib for _, mib in r["saved_tensors"].values()) for v, r in results.items()}
    print(f"{'saved by the graph':24s} {total['timm']:9.1f} {total['flashwin']:9.1f}")
    keys = set(timm["saved_tensors"]) | set(ours["saved_tensors"])
    rows = []
    for key in keys:
        a = timm["saved_tensors"].get(key, (0, 0.0))
        b = ours["saved_tensors"].get(key, (0, 0.0))
        if abs(a[1] - b[1]) > 0.05:
            rows.append((b[1] - a[1], key, a, b))
    rows.sort(key=lambda r: -abs(r[0]))
    print("\nsaved tensors that differ (count x, MiB), largest differences first:")
    for diff, key, a, b in rows[:top]:
        print(f"  {key:44s} timm {a[0]:4d} x {a[1]:8.1f}   patched {b[0]:4d} x {b[1]:8.1f}   {diff:+8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--compile", action="store_true", help="torch.compile's default mode on both sides")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    train = args.mode == "train"
    results = run(args.model, args.batch, "default" if args.compile else None, args.warmup, train)
    if train:
        report(results, args.top)
    report_peaks(results, args.top)
    if args.out:
        write_json(args.out, dict(model=args.model, mode=args.mode, batch=args.batch, compile=args.compile, results=results,
                                  device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version()))


if __name__ == "__main__":
    main()
