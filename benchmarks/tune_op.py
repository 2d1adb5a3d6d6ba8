"""Sweep launch configurations of the kernels on the benchmark shapes.

    python benchmarks/tune_op.py --out results/tune.json

Times the forward and the backward launchers alone (CUDA-graph replays, so host
overhead is out), for each candidate LaunchConfig, and prints registers, spills and
shared memory of each compiled variant. The winners become the defaults in
timm_flashwin/kernels/config.py.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_op import SHAPES, dense_bias, make_inputs  # noqa: E402
from common import write_json  # noqa: E402
from timm_flashwin.kernels.window import backward, backward_dkdv, backward_dq_dbias  # noqa: E402
from timm_flashwin.kernels import config
from timm_flashwin.kernels.window import forward as fwd_kernels  # noqa: E402
from timm_flashwin.kernels.window.bias_mask import reads_mask_apart  # noqa: E402
from timm_flashwin.kernels.window.launch import attention_backward, attention_forward  # noqa: E402
from timm_flashwin.kernels.window.plan import dq_by_atomic_adds  # noqa: E402
from timm_flashwin.ops.dispatch import direct_launches  # noqa: E402


def _compiled(kernel) -> Dict:
    caches = getattr(kernel, "device_caches", None)
    out = {}
    if caches is not None:
        for entry in caches.values():
            out.update(entry[0])
    return out


def _stats(kernels, before: Dict) -> List[str]:
    text = []
    for kernel in kernels:
        for key, compiled in _compiled(kernel).items():
            if key in before.get(id(kernel), {}):
                continue
            name = kernel.fn.__name__.replace("window_attention_", "")
            text.append(f"{name}:regs={compiled.n_regs},spills={compiled.n_spills},"
                        f"smem={compiled.metadata.shared}")
    return text


def candidates(n: int, head_dim: int, base: config.LaunchConfig, which: str, quick: bool = False):
    """Block shapes (multi-block path only), warps, stages and programs per SM around
    ``base``. quick: no programs-per-SM variation and two pipeline depths, for the
    multi-block shapes whose grids are large anyway."""
    blocks = [(base.block_m, base.block_n)]
    if n > 64:
        blocks += [(64, 64), (128, 64), (64, 128), (32, 64)] if which == "fwd" else [(64, 64), (32, 64), (64, 32),
                                                                                       (128, 64)]
    stages = (2, 3) if quick else (1, 2, 3)
    per_sm = (base.programs_per_sm,) if quick else (1, 2, 4, 8, 32, 1024)
    seen = set()
    for (bm, bn), warps, stages, pps in itertools.product(blocks, (4, 8), stages, per_sm):
        if which == "bwd" and base.single_tile(n) and (bm, bn) != (base.block_m, base.block_n):
            continue
        cfg = config.with_changes(base, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                  programs_per_sm=pps)
        if cfg not in seen:
            seen.add(cfg)
            yield cfg


def parse_tiles(spec: str, base: config.LaunchConfig) -> config.LaunchConfig:
    """BMxBN/WARPS[/MAXNREG[/PROGRAMS_PER_SM]] -> base with those tiles. MAXNREG 0: no cap;
    MAXNREG "-" or absent: base's; PROGRAMS_PER_SM absent: base's."""
    parts = spec.split("/")
    block_m, block_n = (int(x) for x in parts[0].split("x"))
    changes = dict(block_m=block_m, block_n=block_n, num_warps=int(parts[1]))
    if len(parts) > 2 and parts[2] != "-":
        changes["maxnreg"] = int(parts[2]) or None
    if len(parts) > 3:
        changes["programs_per_sm"] = int(parts[3])
    return config.with_changes(base, **changes)


def main() -> None:
    from triton.testing import do_bench_cudagraph
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--kinds", nargs="*", default=["v1", "cosine"])
    parser.add_argument("--passes", nargs="*", default=["fwd", "bwd"])
    parser.add_argument("--quick", action="store_true", help="fewer candidates (see candidates())")
    parser.add_argument("--only-default", action="store_true", help="time the default configuration alone")
    parser.add_argument("--without", nargs="*", default=[], choices=["bias", "mask"],
                        help="ablation: leave these inputs out, to see what they cost")
    parser.add_argument("--dense", nargs="*", default=[], choices=["mask"],
                        help="ablation: read the mask densely, without region ids (kernels/config.MASK_REGIONS)")
    parser.add_argument("--bias-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the dense bias handed to the launchers (timm's modules give float32 under "
                             "autocast; with 16-bit inputs the streaming kernels read it as a float16 copy)")
    parser.add_argument("--maxnreg", nargs="*", type=int, default=[-1],
                        help="with --only-default: register caps per thread to time (-1: the default's, "
                             "0: none, the compiler's choice)")
    parser.add_argument("--tiles", nargs="*", default=None,
                        help="with --only-default: the pass's tiles to time instead of the default's, as "
                             "BMxBN/WARPS[/MAXNREG[/PROGRAMS_PER_SM]] (as --dbias-tiles; combined with --maxnreg "
                             "and --stages)")
    parser.add_argument("--stages", nargs="*", type=int, default=[0],
                        help="with --only-default: pipeline depths to time (0: the default's)")
    parser.add_argument("--dq", nargs="*", default=None, choices=["atomic", "kernel"],
                        help="multi-block backward: time each candidate with dQ by atomic adds in the dkdv "
                             "kernel, by its own kernel (what torch.use_deterministic_algorithms(True) runs), "
                             "or both (default: the configuration's own choice)")
    parser.add_argument("--dbias-slots", nargs="*", type=int, default=None,
                        help="multi-block backward: time each candidate with the bias gradient added by the "
                             "dkdv kernel into this many slots with atomic adds (0: by its own kernel)")
    parser.add_argument("--dbias-tiles", nargs="*", default=None,
                        help="multi-block backward with a dbias kernel: its tiles to time, as "
                             "BMxBN/WARPS[/MAXNREG[/PROGRAMS_PER_SM]] (e.g. 64x64/4 64x128/8/0 64x64/4/-/8; "
                             "MAXNREG 0: none, -: the backward's; default: the backward's own tiles)")
    parser.add_argument("--one-region-loop", nargs="*", type=int, default=None, choices=[0, 1],
                        help="kernels that stream key blocks: time each candidate without (0) and with (1) the "
                             "loop copy for windows of one region (LaunchConfig.one_region_loop)")
    parser.add_argument("--flat-loop", nargs="*", type=int, default=None, choices=[0, 1],
                        help="forward and multi-block backward: time each candidate with a loop over blocks per "
                             "window (0) and with one loop over (window, block) steps (1) (LaunchConfig.flat_loop)")
    parser.add_argument("--grads", nargs="*", default=["all"], choices=["all", "bias", "scale", "none"],
                        help="backward: which of the bias and logit-scale gradients to compute, for what each "
                             "costs (all: both, as training asks; bias, scale: that one only; none: dqkv only)")
    parser.add_argument("--deterministic", action="store_true",
                        help="time under torch.use_deterministic_algorithms(True): no atomic adds (dQ by its "
                             "own kernel, the bias gradient by the dbias kernel, which writes partials)")
    parser.add_argument("--inference", action="store_true",
                        help="time the forward as under no_grad: no softmax statistics saved")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config.MASK_REGIONS = "mask" not in args.dense
    torch.use_deterministic_algorithms(args.deterministic)
    results = []
    for shape_name, kind, which in itertools.product(args.shapes, args.kinds, args.passes):
        windows, heads, n, head_dim, _ = SHAPES[shape_name]
        cosine = kind == "cosine"
        inp = make_inputs(SHAPES[shape_name], cosine)
        qkv, mask = inp["qkv"].detach(), inp["mask"]
        bias = dense_bias(inp["bias"].detach(), n).to(getattr(torch, args.bias_dtype))  # as the adapters pass it
        bias = None if "bias" in args.without else bias
        mask = None if "mask" in args.without else mask
        logit_scale = inp["logit_scale"].detach() if cosine else None  # (H,): the kernels clamp and exponentiate
        key = (which, n, head_dim, torch.bfloat16, cosine)
        if which == "fwd":  # as the launcher picks it: the mask folded into the bias copy or read
            base = config.forward_config(n, head_dim, torch.bfloat16, cosine, False,
                                         reads_mask_apart(mask, torch.bfloat16, heads, n))
        else:
            base = config.backward_config(n, head_dim, torch.bfloat16, cosine)
        kernels = [fwd_kernels.window_attention_fwd_kernel] if which == "fwd" else [
            backward.window_attention_bwd_fused_kernel, backward_dkdv.window_attention_bwd_dkdv_kernel,
            backward_dq_dbias.window_attention_bwd_dq_kernel, backward_dq_dbias.window_attention_bwd_dq_finish_kernel,
            backward_dq_dbias.window_attention_bwd_dbias_kernel]
        out, stats, regions, mask_info = attention_forward(qkv, heads, bias, mask, logit_scale, inp["scale"], cosine)
        best = None
        if args.only_default:
            tiled = [parse_tiles(spec, base) for spec in args.tiles] if args.tiles else [base]
            configs = [config.with_changes(cfg, maxnreg=cfg.maxnreg if regs < 0 else regs or None,
                                           num_stages=stages or cfg.num_stages)
                       for cfg in tiled for regs in args.maxnreg for stages in args.stages]
        else:
            configs = list(candidates(n, head_dim, base, which, args.quick))
        multi_block_bwd = which == "bwd" and not base.single_tile(n)
        dq_paths = args.dq if args.dq and multi_block_bwd else [None]
        configs = [cfg if dq_path is None else config.with_changes(cfg, dq_atomic=dq_path == "atomic")
                   for cfg in configs for dq_path in dq_paths]
        if args.dbias_slots and multi_block_bwd:
            configs = [config.with_changes(cfg, dbias_slots=slots) for cfg in configs for slots in args.dbias_slots]
        if args.one_region_loop is not None:
            configs = [config.with_changes(cfg, one_region_loop=bool(on)) for cfg in configs
                       for on in args.one_region_loop]
        if args.flat_loop is not None and (which == "fwd" or multi_block_bwd):
            configs = [config.with_changes(cfg, flat_loop=bool(on)) for cfg in configs for on in args.flat_loop]
        dbias_key = ("dbias",) + key[1:]
        dbias_specs = args.dbias_tiles if args.dbias_tiles and multi_block_bwd else [None]
        configs = [(cfg, spec) for cfg in configs for spec in (dbias_specs if cfg.dbias_slots == 0 else [None])]
        grad_sets = args.grads if which == "bwd" else ["all"]
        configs = [(cfg, spec, grads) for cfg, spec in configs for grads in grad_sets]
        for cfg, dbias_spec, grads in configs:
            bias_grad = bias is not None and grads in ("all", "bias")
            scale_grad = cosine and grads in ("all", "scale")
            dq_path = "atomic" if dq_by_atomic_adds(cfg) else "kernel"  # the kernel under --deterministic
            config.OVERRIDES[key] = cfg
            dbias_tiles = None if dbias_spec is None else parse_tiles(dbias_spec, cfg)
            if dbias_tiles is not None:
                config.OVERRIDES[dbias_key] = dbias_tiles
            before = {id(k): dict(_compiled(k)) for k in kernels}
            try:
                if which == "fwd":
                    launch = lambda: attention_forward(qkv, heads, bias, mask, logit_scale, inp["scale"], cosine,  # noqa
                                                       save_stats=not args.inference)
                else:
                    launch = lambda: attention_backward(inp["grad"], qkv, out, stats, regions, mask_info,  # noqa
                                                        bias, mask, logit_scale, heads, inp["scale"], cosine,
                                                        bias_grad, scale_grad)

                def fn(launch=launch):
                    with direct_launches():  # as in eager use: launch options include the register cap
                        return launch()
                fn()
                torch.cuda.synchronize()
                us = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception as exc:
                print(f"{shape_name} {kind} {which} {cfg} FAILED {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            finally:
                config.OVERRIDES.pop(key, None)
                config.OVERRIDES.pop(dbias_key, None)
            info = _stats(kernels, before)
            is_default = (cfg == base and (dbias_tiles is None or dbias_tiles == config.dbias_config(*key[1:]))
                          and grads == "all")
            row = dict(shape=shape_name, kind=kind, which=which, us=us, is_default=is_default,
                       dq=dq_path, grads=grads,
                       without=args.without, dense=args.dense, bias_dtype=args.bias_dtype, inference=args.inference,
                       deterministic=args.deterministic,
                       dbias_tiles=dbias_spec, **cfg.__dict__)
            results.append(row)
            mark = "*" if is_default else " "
            print(f"{shape_name:11s} {kind:6s} {which} {mark} {us:8.1f} us  bm={cfg.block_m} bn={cfg.block_n} "
                  f"w={cfg.num_warps} s={cfg.num_stages} pps={cfg.programs_per_sm} regs<={cfg.maxnreg} dq={dq_path} "
                  f"slots={cfg.dbias_slots} dbias={dbias_spec or 'same'} grads={grads} one_region_loop={int(cfg.one_region_loop)} flat_loop={int(cfg.flat_loop)} "
                  f"{' '.join(info)}", flush=True)
            if grads == "all" and (best is None or us < best[0]):
                best = (us, (cfg, dbias_spec) if dbias_spec else cfg)
        default_us = next((r["us"] for r in results if r["is_default"] and r["shape"] == shape_name
                           and r["kind"] == kind and r["which"] == which), float("nan"))
        if best is not None:  # none where every candidate failed, or with --grads lacking "all"
            print(f"BEST {shape_name} {kind} {which} without={args.without} dense={args.dense}: "
                  f"{best[0]:.1f} us (default {default_us:.1f}) "
                  f"{best[1]}", flush=True)
        if args.out:  # after every case, so that a run cut short keeps what it measured
            write_json(args.out, results)


if __name__ == "__main__":
    main()
