"""Compile the window kernels for a GPU architecture without one, as a subprocess of the tests.

The interpreter (how CI runs the kernels) executes them as numpy code and cannot see what
only the compiler checks: constexpr branches, types carried through loops, the sizes of
tiles in registers, the shared memory a program takes. This script builds the launch
configurations the plans choose for an architecture (kernels/config.py fitted to its
limits, kernels/arch.py) for representative shapes with triton.compile, prints each
kernel's registers, stack frame (where spilled registers go) and shared memory, and exits
non-zero if any fails to build or takes more shared memory than the architecture has.

    TRITON_INTERPRET=0 python tests/arch_build.py            # sm_90: every case and the bias copy
    TRITON_INTERPRET=0 python tests/arch_build.py 0 3 copy   # CASES[0], CASES[3] and the copy
    TRITON_INTERPRET=0 python tests/arch_build.py --arch sm_86 4
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# run from a checkout as well as after `pip install -e .`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timm_flashwin.kernels.window import backward, backward_dkdv, backward_dq_dbias
from timm_flashwin.kernels.window import config  # noqa: E402
from timm_flashwin.kernels.arch import KNOWN, Arch  # noqa: E402
from timm_flashwin.kernels.window.bias_copy import float16_bias_copy_kernel  # noqa: E402
from timm_flashwin.kernels.window.forward import window_attention_fwd_kernel  # noqa: E402
from timm_flashwin.kernels.window.bias_mask import folds_mask  # noqa: E402
from timm_flashwin.kernels.window.call import DENSE_BIAS, LOG2E_COPY, TABLE_BIAS  # noqa: E402
from timm_flashwin.kernels.launcher import compiler_options, launch_options  # noqa: E402
from timm_flashwin.kernels.window.plan import call_plan  # noqa: E402
from window_calls import window_call  # noqa: E402
from timm_flashwin.ops.dispatch import direct_launches  # noqa: E402

#: the architecture the builds are for (``main``'s --arch), and its target
ARCH: Arch = KNOWN["sm_90"]
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
#: (N, head_dim, dtype, cosine, dropout): one-tile and multi-block windows, the largest
#: window and head_dim, a head_dim that is not a power of two, every dtype; 256 in float32
#: and 1024 in bf16 (its bias + mask copy too large to fold) build the kernels that read
#: the mask's region ids, 256 in float32 with the one-region loop copy (V1: forward and
#: dkdv kernel), 256 in bf16 the forward's key blocks of 128 (config._wide_key_blocks).
CASES = [
    (49, 32, torch.bfloat16, True, True),
    (49, 32, torch.float16, False, False),
    (64, 32, torch.float32, True, False),
    (256, 32, torch.float32, False, False),
    (144, 32, torch.bfloat16, True, True),
    (1024, 32, torch.bfloat16, False, False),
    (256, 32, torch.bfloat16, True, False),
    (256, 32, torch.bfloat16, False, False),
    (49, 256, torch.bfloat16, True, False),
    (100, 24, torch.float16, False, True),
]
#: CASES index -> GLOBAL_QUERY (tiles.query_base) of the queries read from a tensor of their
#: own (GCViT's global query), built besides the queries in qkv: the forward and the one-tile
#: backward (tiled order), the forward and every multi-block backward kernel (image-major)
SHARED_QUERY = {0: 2, 4: 1}
#: kernel arguments holding activations (the input's dtype); other pointers are fp32
ACTIVATION_POINTERS = {"qkv_ptr", "q_ptr", "out_ptr", "dout_ptr", "dqkv_ptr"}


def signature(kernel, dtype: torch.dtype, constexprs: dict, bias_dtype: torch.dtype = torch.float32) -> dict:
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name == "bias_ptr":
            types[name] = "*" + TRITON_TYPES[bias_dtype]
        elif name == "seed_ptr":
            types[name] = "*i64"
        elif name in ("regions_ptr", "bias_index_ptr"):
            types[name] = "*i32"
        elif name.endswith("_ptr"):
            types[name] = "*" + (TRITON_TYPES[dtype] if name in ACTIVATION_POINTERS else "fp32")
        elif name in ("scale", "dropout_p"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def as_launched(kernel, types: dict, constexprs: dict):
    """(types, constexprs, attrs) specialized as a GPU launch specializes them on
    contiguous tensors: unit strides become constants, and pointers and the integers that
    are multiples of 16 carry that divisibility. Without this the build would gather every
    element and misreport registers and spills."""
    n, channels = constexprs["N"], constexprs["H"] * constexprs["D"]
    values = dict(stride_qkv_b=n * 3 * channels, stride_qkv_n=3 * channels, stride_q_b=n * channels,
                  stride_q_n=channels, stride_dqkv_b=n * 3 * channels,
                  stride_dqkv_n=3 * channels, stride_out_b=n * channels, stride_out_n=channels,
                  stride_dout_b=n * channels, stride_dout_n=channels, stride_bias_w=3 * n * n, stride_bias_h=n * n,
                  stride_bias_i=n,
                  stride_mask_w=n * n, stride_mask_i=n, num_periods=16, stats_stride=256 * n)
    types, constexprs = dict(types), dict(constexprs)
    for name in kernel.arg_names:
        if name.startswith("stride_") and name.endswith(("_c", "_j")):
            types[name] = "constexpr"
            constexprs[name] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if types[name] != "constexpr" and (name.endswith("_ptr") or values.get(name, 1) % 16 == 0)}
    return types, constexprs, attrs


def registers_and_stack(cubin: bytes):
    """(registers, stack frame bytes) of a build, None where cuobjdump cannot say."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)  # register spills live in the stack frame
    return (int(found[1]), int(found[2])) if found else None


def resource_usage(cubin: bytes) -> str:
    found = registers_and_stack(cubin)
    return f"registers {found[0]}, stack frame {found[1]} B" if found else "resource usage unavailable"


def build(kernel, dtype: torch.dtype, constexprs: dict, launch: config.LaunchConfig,
          bias_dtype: torch.dtype = torch.float32, shared_query: int = 0) -> None:
    """One build of ``kernel``, the queries in qkv (GLOBAL_QUERY 0), and where ``shared_query``
    is a GLOBAL_QUERY another with it."""
    for query in (0, shared_query) if shared_query else (0,):
        _build(kernel, dtype, dict(constexprs, GLOBAL_QUERY=query), launch, bias_dtype)


def target(arch: Arch) -> GPUTarget:
    """Triton's target for ``arch`` (NVIDIA: warp size 32)."""
    return GPUTarget("cuda", arch.capability, 32)


#: builds whose shared memory exceeded ARCH's (``report``); ``main`` exits non-zero on any
TOO_LARGE: list = []


def _build(kernel, dtype: torch.dtype, constexprs: dict, launch: config.LaunchConfig,
           bias_dtype: torch.dtype = torch.float32) -> None:
    types, constexprs, attrs = as_launched(kernel, signature(kernel, dtype, constexprs, bias_dtype), constexprs)
    source = ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs)
    with direct_launches():  # the options of an eager launch: the register cap included
        options = launch_options(launch, constexprs.get("HAS_DROPOUT", False))
    report(kernel.fn.__name__, triton.compile(source, target=target(ARCH), options=options), ARCH)


def report(name: str, compiled, arch: Arch) -> int:
    """Prints a build's registers, stack frame and shared memory; returns the shared memory,
    noted in TOO_LARGE where ``arch`` has less."""
    shared = compiled.metadata.shared
    fits = shared <= arch.shared_memory
    if not fits:
        TOO_LARGE.append(name)
    print(f"  {name:40s} {resource_usage(compiled.asm['cubin'])}, shared {shared} B"
          f"{'' if fits else f'  DOES NOT FIT {arch.name} ({arch.shared_memory} B)'}", flush=True)
    return shared


def build_bias_copy() -> None:
    """The float16 copy of bias + mask (bias_mask.streamed_bias): float32 in, float16 out."""
    types = dict(bias_ptr="*fp32", mask_ptr="*fp32", out_ptr="*fp16", numel="i32", n="i32", heads="i32",
                 stride_h="i32", stride_i="i32", stride_j="i32", stride_mask_w="i32", stride_mask_i="i32",
                 stride_mask_j="i32", HAS_BIAS="constexpr", HAS_MASK="constexpr", BLOCK="constexpr")
    source = ASTSource(fn=float16_bias_copy_kernel, signature=types,
                       constexprs=dict(HAS_BIAS=True, HAS_MASK=True, BLOCK=1024),
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    with direct_launches():
        options = compiler_options()
    report(float16_bias_copy_kernel.fn.__name__, triton.compile(source, target=target(ARCH), options=options), ARCH)


def main(selected: list) -> int:
    """Build CASES[i] for each index in ``selected`` and the bias copy where it names "copy"
    (everything where it is empty), for the architecture ``--arch NAME`` names (sm_90
    without it); non-zero where a build takes more shared memory than it has."""
    global ARCH
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    if "--arch" in selected:
        at = selected.index("--arch")
        ARCH, selected = KNOWN[selected[at + 1]], selected[:at] + selected[at + 2:]
    if not selected:
        selected = [*map(str, range(len(CASES))), "copy"]
    for index in (int(i) for i in selected if i != "copy"):
        n, head_dim, dtype, cosine, dropout = CASES[index]
        query = SHARED_QUERY.get(index, 0)
        # the partitioned layout (MAPPED 0), or the feature-map layout of square windows (every
        # case's N is a square): block windows (1), MaxViT's strided grid windows (2)
        layout = lambda mapped: dict(MAPPED=int(mapped), WINDOW_W=math.isqrt(n) if mapped else 1)  # noqa: E731
        # a dense bias, or a table: V1's read as it is, SwinV2's through 16 * sigmoid
        bias_table = lambda table: dict(BIAS=TABLE_BIAS if table else DENSE_BIAS,  # noqa: E731
                                        BIAS_SIGMOID=16.0 if table and cosine else 0.0)
        print(f"N={n} head_dim={head_dim} {TRITON_TYPES[dtype]} {'cosine' if cosine else 'v1'}"
              f"{' dropout' if dropout else ''}")
        flags = dict(H=3, N=n, D=head_dim, BIAS=DENSE_BIAS, HAS_MASK=True, COSINE=cosine,
                     FP32_DOT=dtype == torch.float32, HAS_DROPOUT=dropout)
        call = window_call(n, head_dim, dtype, cosine, dropout, ARCH, heads=3, periods=16)  # 16 mask windows, 3 heads
        folded = folds_mask(call)
        fwd = config.forward_config(n, head_dim, dtype, cosine, dropout, reads_mask=not folded, arch=ARCH)
        bwd = config.backward_config(n, head_dim, dtype, cosine, ARCH)
        streamed = n > fwd.block_n
        # the partitioned and the feature-map layout, and where the kernels of both passes read a
        # position bias from its table (CallPlan.reads_table), the latter with the table too
        table = call_plan(call).reads_table
        layouts = ((0, False), (1, False)) + (((1, True),) if table else ())
        if n in (49, 64) and head_dim == 32:  # MaxViT's windows: its grid windows too
            layouts += ((2, table),)
        # kernels that stream key blocks read, with 16-bit inputs, a float16 copy of bias + mask
        # times log2(e) and no mask of their own where that copy is small (bias_mask.streamed_bias),
        # else the bias (float16 copy with 16-bit inputs) and the mask's region ids, one build
        # per kind of mask
        streamed_bias = torch.float16 if dtype != torch.float32 else torch.float32
        streaming = dict(HAS_MASK=not folded, MASK_REGIONS=not folded,
                         BIAS=LOG2E_COPY if dtype != torch.float32 else DENSE_BIAS)
        kinds = (False,) if folded else (True, False)
        fwd_blocks = dict(flags, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, BLOCK_D=fwd.block_d,
                          ONE_REGION_LOOP=fwd.one_region_loop, FLAT_LOOP=fwd.flat_loop)
        if streamed:
            for from_regions in kinds:
                build(window_attention_fwd_kernel, dtype, dict(fwd_blocks, **streaming, FROM_REGIONS=from_regions,
                                                               STORE_STATS=not bwd.single_tile(n), **layout(False),
                                                               BIAS_SIGMOID=0.0),
                      fwd, streamed_bias, query if from_regions == kinds[0] else 0)
            if not dropout:  # inference: no statistics (cosine: no mean score), either layout
                for mapped in (False, True):
                    build(window_attention_fwd_kernel, dtype,
                          dict(fwd_blocks, **streaming, FROM_REGIONS=kinds[0], STORE_STATS=False, **layout(mapped),
                               BIAS_SIGMOID=0.0), fwd, streamed_bias)
        else:
            for mapped, table in layouts:
                build(window_attention_fwd_kernel, dtype, dict(fwd_blocks, STORE_STATS=not bwd.single_tile(n),
                                                               MASK_REGIONS=False, FROM_REGIONS=False,
                                                               **layout(mapped), **bias_table(table)), fwd,
                      shared_query=query if not mapped and not table else 0)
        if bwd.single_tile(n):
            for mapped, table in layouts:
                build(backward.window_attention_bwd_fused_kernel, dtype,
                      dict(flags, BLOCK_N=bwd.block_n, BLOCK_D=bwd.block_d, BIAS_GRAD=True, SCALE_GRAD=cosine,
                           **layout(mapped), **bias_table(table)), bwd,
                      shared_query=query if not mapped and not table else 0)
            continue
        blocks = dict(flags, **streaming, BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, BLOCK_D=bwd.block_d)
        # as configured (atomic dQ, the bias gradient by atomics where bwd.dbias_slots), one build
        # per mask kind as launched, and as in deterministic mode (the dq and dbias kernels do
        # that work)
        for atomics, from_regions in [(True, kind) for kind in kinds] + [(False, kinds[0])]:
            build(backward_dkdv.window_attention_bwd_dkdv_kernel, dtype,
                  dict(blocks, DQ_ATOMIC=atomics and bwd.dq_atomic, SCALE_GRAD=cosine and atomics and bwd.dq_atomic,
                       DBIAS_ATOMIC=atomics and bwd.dbias_slots > 0, FROM_REGIONS=from_regions,
                       ONE_REGION_LOOP=bwd.one_region_loop, FLAT_LOOP=bwd.flat_loop), bwd, streamed_bias,
                  query if atomics and from_regions == kinds[0] else 0)
        build(backward_dq_dbias.window_attention_bwd_dq_finish_kernel, dtype,
              dict(H=3, N=n, D=head_dim, BLOCK_M=bwd.block_m, BLOCK_D=bwd.block_d, COSINE=cosine),
              config.with_changes(bwd, num_warps=4, maxnreg=None), shared_query=query)
        build(backward_dq_dbias.window_attention_bwd_dq_kernel, dtype,
              dict(blocks, SCALE_GRAD=cosine, FROM_REGIONS=kinds[0]), bwd, streamed_bias, query)
        dbias = config.dbias_config(n, head_dim, dtype, cosine, ARCH)
        for atomic_sum in (True, False):  # as by default, and as in deterministic mode
            build(backward_dq_dbias.window_attention_bwd_dbias_kernel, dtype,
                  dict(blocks, BLOCK_M=dbias.block_m, BLOCK_N=dbias.block_n, BLOCK_D=dbias.block_d,
                       ATOMIC_SUM=atomic_sum), dbias, streamed_bias, query if atomic_sum else 0)
    if "copy" in selected:
        build_bias_copy()
    if TOO_LARGE:
        print(f"{len(TOO_LARGE)} builds take more shared memory than {ARCH.name} has", file=sys.stderr)
    return 1 if TOO_LARGE else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
