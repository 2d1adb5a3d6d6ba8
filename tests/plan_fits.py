"""Every launch configuration the plans choose fits its architecture's shared memory, checked
by compile-only builds (triton.compile with a GPUTarget, no GPU), as a subprocess of the tests.

For sm_80, 86, 89, 90, 100 and 120 (``kernels/arch.py``'s limits), the plans are asked for
every window shape of every served timm model at its default size (``model_shapes.json``,
made by ``tests/model_shapes.py``) and of the window build cases (``arch_build.CASES``), in
float32, float16 and bfloat16, with and without attention dropout, a mask read or not, and
for the local-attention operators at head_dim 32 to 256 in every class of rows. The
configurations they choose are built once each: a configuration chosen for several shapes
or architectures of one code-generation family is one build (sm_80, sm_86 and sm_89 compile
to the same mma.sync code and shared-memory layout: ``CROSS_CHECKS`` builds a few for all
three and compares), with the heaviest variant of its kernel (a dense mask and a bias read
per key block; sink, dropout and blocks for the local kernels). Exits non-zero where a build
takes more shared memory than the smallest budget of the architectures that chose it, more
than the estimate the plans fitted it by (kernels/budget.py), or spills more registers than
the tuned plans do on sm_90 (``SPILL_LIMIT``).

    TRITON_INTERPRET=0 python tests/plan_fits.py --count          # the builds, per family
    TRITON_INTERPRET=0 python tests/plan_fits.py --part 0/4       # the first quarter of them
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import arch_build  # noqa: E402
import local_arch_build  # noqa: E402
from timm_flashwin.ops.dispatch import direct_launches  # noqa: E402
from timm_flashwin.kernels.window import backward, backward_dkdv, backward_dq_dbias
from timm_flashwin.kernels import budget  # noqa: E402
from timm_flashwin.kernels.sizes import tile_side  # noqa: E402
from timm_flashwin.kernels.window import config  # noqa: E402
from timm_flashwin.kernels.window.call import DENSE_BIAS, LOG2E_COPY  # noqa: E402
from timm_flashwin.kernels.local import plan as local_plan  # noqa: E402,E501
from timm_flashwin.kernels.arch import KNOWN, Arch  # noqa: E402
from timm_flashwin.kernels.window.forward import window_attention_fwd_kernel  # noqa: E402
from timm_flashwin.kernels.launcher import compiler_options, launch_options  # noqa: E402
from timm_flashwin.kernels.local.backward import local_attention_bwd_dkdv_kernel, local_attention_bwd_dq_kernel
from timm_flashwin.kernels.local.forward import local_attention_fwd_kernel  # noqa: E402

ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
#: the architecture whose builds stand for each one's (``CROSS_CHECKS``)
FAMILY = {"sm_80": "sm_86", "sm_86": "sm_86", "sm_89": "sm_86", "sm_90": "sm_90", "sm_100": "sm_100",
          "sm_120": "sm_120"}
#: a build's stack frame (its spilled registers) on the families whose plans are fitted, at
#: most what the tuned plans' builds take on sm_90: 10.6 KB at the most, the float32 dq kernel
#: at head_dim 256 (32 x 32 tiles; every configuration built, 2026-11-28). Not checked for
#: sm_100, whose builds of the same tuned plans spill more (14.5 KB: the float32 dkdv kernel
#: at head_dim 256; docs/support.md)
SPILL_LIMIT, SPILL_CHECKED = 11 << 10, ("sm_86", "sm_120")
#: builds made for every member of the sm_86 family (by the first part), whose shared memory
#: must agree
CROSS_CHECKS = 3
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES_FILE = Path(__file__).with_name("model_shapes.json")
LOCAL_HEAD_DIMS = (32, 64, 96, 128, 256)

#: one build: (kernel, dtype, constexprs, compile options); keyed without N and H (the
#: shared memory a program takes follows its tiles)
Build = Tuple[object, torch.dtype, dict, dict]


def window_shapes() -> List[Tuple[int, int, bool]]:
    """(N, head_dim, cosine) of every served model's window attention and of the build cases."""
    shapes = {(n, d, bool(c)) for n, d, c, _models in json.loads(SHAPES_FILE.read_text())}
    shapes |= {(n, d, c) for n, d, _dtype, c, _dropout in arch_build.CASES}
    return sorted(shapes)


def _window_builds(n: int, head_dim: int, cosine: bool, dtype: torch.dtype, dropout: bool, reads_mask: bool,
                   arch: Arch) -> List[Build]:
    """The builds of what the plans choose for one signature on ``arch``."""
    flags = dict(H=1, N=n, D=head_dim, BIAS=DENSE_BIAS, COSINE=cosine, FP32_DOT=dtype == torch.float32,
                 HAS_DROPOUT=dropout, GLOBAL_QUERY=0)
    # a float16 bias copy where 16-bit inputs stream key blocks
    streaming = dict(HAS_MASK=reads_mask, MASK_REGIONS=reads_mask,
                     BIAS=LOG2E_COPY if dtype != torch.float32 else DENSE_BIAS)
    fwd = config.forward_config(n, head_dim, dtype, cosine, dropout, reads_mask, arch)
    bwd = config.backward_config(n, head_dim, dtype, cosine, arch)
    layout = dict(MAPPED=0, WINDOW_W=1, BIAS_SIGMOID=0.0)
    builds = []
    streamed = n > fwd.block_n
    fwd_flags = dict(flags, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, BLOCK_D=fwd.block_d,
                     ONE_REGION_LOOP=fwd.one_region_loop, FLAT_LOOP=fwd.flat_loop, STORE_STATS=not bwd.single_tile(n),
                     **layout)
    fwd_flags.update(streaming if streamed else dict(HAS_MASK=True, MASK_REGIONS=False), FROM_REGIONS=False)
    builds.append((window_attention_fwd_kernel, dtype, fwd_flags, launch_options(fwd, dropout)))
    if dropout:  # the backward's configuration does not depend on dropout: built without it
        return builds
    if bwd.single_tile(n):
        builds.append((backward.window_attention_bwd_fused_kernel, dtype,
                       dict(flags, HAS_MASK=True, BLOCK_N=bwd.block_n, BLOCK_D=bwd.block_d, BIAS_GRAD=True,
                            SCALE_GRAD=cosine, **layout), launch_options(bwd, False)))
        return builds
    blocks = dict(flags, **streaming, BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, BLOCK_D=bwd.block_d)
    builds.append((backward_dkdv.window_attention_bwd_dkdv_kernel, dtype,
                   dict(blocks, DQ_ATOMIC=bwd.dq_atomic, SCALE_GRAD=cosine and bwd.dq_atomic,
                        DBIAS_ATOMIC=bwd.dbias_slots > 0, ONE_REGION_LOOP=bwd.one_region_loop,
                        FLAT_LOOP=bwd.flat_loop, FROM_REGIONS=False), launch_options(bwd, False)))
    builds.append((backward_dq_dbias.window_attention_bwd_dq_kernel, dtype,
                   dict(blocks, SCALE_GRAD=cosine, FROM_REGIONS=False), launch_options(bwd, False)))
    dbias = config.dbias_config(n, head_dim, dtype, cosine, arch)
    builds.append((backward_dq_dbias.window_attention_bwd_dbias_kernel, dtype,
                   dict(blocks, BLOCK_M=dbias.block_m, BLOCK_N=dbias.block_n, BLOCK_D=dbias.block_d, ATOMIC_SUM=True),
                   launch_options(dbias, False)))
    return builds


def _local_builds(head_dim: int, dtype: torch.dtype, arch: Arch) -> List[Build]:
    flags = dict(D=head_dim, BLOCK_D=tile_side(head_dim), PERIODIC=True, HAS_SINK=True, HAS_DROPOUT=True,
                 PRECISION=local_plan.precision(dtype), COUNT_TILES=False, BIAS=0, ROW_TILE=False, KEY_H_PAD=16,
                 KEY_W_PAD=16)
    builds = []
    for kind, kernel in (("fwd", local_attention_fwd_kernel), ("dkdv", local_attention_bwd_dkdv_kernel),
                         ("dq", local_attention_bwd_dq_kernel)):
        plans = [local_plan.plan(kind, head_dim, dtype, rows, arch=arch)
                 for rows in (local_plan.SHORT, local_plan.LONG, local_plan.TALL)]
        plans += [local_plan.plan(kind, head_dim, dtype, local_plan.SHORT, *lengths, arch=arch)
                  for lengths in ((4, 16), (16, 64))]
        extra = dict(FOLD_SCALE=local_plan.fold_scale(1.0, head_dim)) if kind == "fwd" else {}
        for tiles in dict.fromkeys(plans):
            builds.append((kernel, dtype, dict(flags, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **extra),
                           dict(compiler_options(tiles.num_warps), num_stages=tiles.num_stages)))
    return builds


#: the constexprs that decide what a kernel keeps in shared memory: its tiles, whether it reads
#: a mask tile, and the loops' shapes; not N, H, the head's width within its tile, cosine
#: attention or the layout (sm_86 builds: the same shared memory), nor what ``_heaviest``
#: builds in any case (dropout's random numbers, the statistics stored); warps and stages
SHAPING = {"BLOCK_M", "BLOCK_N", "BLOCK_D", "HAS_MASK", "MASK_REGIONS", "ONE_REGION_LOOP", "FLAT_LOOP",
           "DQ_ATOMIC", "DBIAS_ATOMIC", "PRECISION", "FOLD_SCALE"}


def _heaviest(build: Build, key: Tuple) -> Build:
    """``build`` as it stands for its key: 16-bit inputs as bfloat16, head_dim the whole tile,
    cosine attention (its norms) where the configuration allows it (not with V1's one-region
    loop copy)."""
    kernel, dtype, constexprs, options = build
    constexprs = dict(constexprs, D=constexprs["BLOCK_D"], HAS_DROPOUT=True,
                      **({"STORE_STATS": True} if "STORE_STATS" in constexprs else {}))
    options = dict(options)
    options.pop("maxnreg", None)  # as launches with dropout (launcher.launch_options)
    if "COSINE" in constexprs:
        cosine = not constexprs.get("ONE_REGION_LOOP", False)
        constexprs.update(COSINE=cosine, **{k: cosine for k in ("SCALE_GRAD",) if k in constexprs})
    return kernel, torch.bfloat16 if dtype.itemsize == 2 else dtype, constexprs, options


def planned_builds() -> Dict[Tuple, Tuple[Build, List[str]]]:
    """Every build the plans call for, once per code-generation family: key -> (build, the
    architectures that chose it)."""
    found: Dict[Tuple, Tuple[Build, List[str]]] = {}

    def add(name: str, build: Build) -> None:
        kernel, dtype, constexprs, options = build
        key = (FAMILY[name], kernel.fn.__name__, dtype.itemsize,
               tuple(sorted((k, v) for k, v in constexprs.items() if k in SHAPING)),
               options["num_warps"], options["num_stages"])
        if key in found:
            found[key][1].append(name)
        else:  # built with bfloat16 for 16-bit inputs, the widest head of its tile and the heaviest flags
            found[key] = (_heaviest(build, key), [name])

    with direct_launches():  # the options of an eager launch (the register caps included)
        for name in ARCHES:
            arch = KNOWN[name]
            for n, head_dim, cosine in window_shapes():
                for dtype in DTYPES:
                    for dropout in (False, True):
                        for reads_mask in (True, False):
                            for build in _window_builds(n, head_dim, cosine, dtype, dropout, reads_mask, arch):
                                add(name, build)
            for head_dim in LOCAL_HEAD_DIMS:
                for dtype in DTYPES:
                    for build in _local_builds(head_dim, dtype, arch):
                        add(name, build)
    return found


def estimate(build: Build) -> int:
    """``budget``'s estimate of a build's shared memory (what the plans fit on sm_80 to sm_89
    and sm_120)."""
    kernel, dtype, constexprs, options = build
    name = kernel.fn.__name__
    tiles = (constexprs.get("BLOCK_M", constexprs["BLOCK_N"]), constexprs["BLOCK_N"], tile_side(constexprs["D"]),
             options["num_stages"], dtype.itemsize)
    if name.startswith("local_"):
        return budget.local_shared_bytes(name.split("_")[-2], *tiles)
    kind = name.replace("window_attention_", "").replace("bwd_", "").replace("_kernel", "")
    streamed = kind not in ("fwd", "fused") or constexprs["N"] > tiles[1]
    return budget.window_shared_bytes(kind, *tiles, streamed, 4 if constexprs["HAS_MASK"] and streamed else 0)


def nearest(builds: List, count: int) -> List:
    """The ``count`` builds of each family whose estimate comes nearest their budget (or over:
    Hopper's and Blackwell's tuned configurations are not fitted)."""
    chosen = []
    for family in sorted(set(FAMILY.values())):
        members = [(key, (build, names)) for key, (build, names) in builds if key[0] == family]
        members.sort(key=lambda item: -estimate(item[1][0]) / min(KNOWN[n].shared_memory for n in item[1][1]))
        chosen += members[:count]
    return chosen


def compile_build(build: Build, arch: Arch):
    kernel, dtype, constexprs, options = build
    if kernel.fn.__name__.startswith("local_"):
        types, constexprs, attrs = local_arch_build.signature(kernel, dtype, constexprs)
    else:
        types, constexprs, attrs = arch_build.as_launched(kernel, arch_build.signature(kernel, dtype, constexprs),
                                                          constexprs)
    source = ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=arch_build.target(arch), options=options)


def main(argv: List[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    builds = sorted(planned_builds().items(), key=lambda item: str(item[0]))
    if "--count" in argv:
        for family in sorted(set(FAMILY.values())):
            print(family, sum(key[0] == family for key, _ in builds))
        print("total", len(builds))
        return 0
    if "--nearest" in argv:
        builds = nearest(builds, int(argv[argv.index("--nearest") + 1]))
    part, parts = map(int, argv[argv.index("--part") + 1].split("/")) if "--part" in argv else (0, 1)
    failed, checked = 0, 0
    for index, (key, (build, names)) in enumerate(builds):
        if index % parts != part:
            continue
        limit = min((KNOWN[name] for name in names), key=lambda a: a.shared_memory)
        family, kernel, constexprs = KNOWN[key[0]], build[0].fn.__name__, build[2]
        print(f"{family.name} {kernel} {constexprs.get('BLOCK_M', '-')}x{constexprs['BLOCK_N']}x{constexprs['D']} "
              f"{key[-2]}w {key[-1]}s {8 * key[2]}-bit for {','.join(sorted(set(names)))}, estimate {estimate(build)} B:",
              flush=True)
        compiled = compile_build(build, family)
        shared = arch_build.report("", compiled, limit)
        failed += shared > limit.shared_memory
        stack = (arch_build.registers_and_stack(compiled.asm["cubin"]) or (0, 0))[1]
        if family.name in SPILL_CHECKED and stack > SPILL_LIMIT:
            print(f"  SPILLS {stack} B, over sm_90's {SPILL_LIMIT} B", flush=True)
            failed += 1
        # the plans of the fitted families rely on the estimate holding what the compiler allocates
        if not budget.keeps_tuned(family) and estimate(build) < shared:
            print(f"  UNDERESTIMATED: {estimate(build)} B < {shared} B", flush=True)
            failed += 1
        if family.name == "sm_86" and part == 0 and checked < CROSS_CHECKS:
            checked += 1
            for other in ("sm_80", "sm_89"):
                again = compile_build(build, KNOWN[other]).metadata.shared
                print(f"  the same build for {other}: shared {again} B", flush=True)
                failed += again != shared
    print(f"{failed} builds over their budget, underestimated, spilling past sm_90's or differing within a family",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
