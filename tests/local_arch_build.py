"""Compile the local-attention kernels for a GPU architecture (sm_90 by default) without one.

What the interpreter cannot check: constexpr branches, loop-carried types, and whether a
launch plan (kernels/local/launch.py, fitted to the architecture: kernels/budget.py) fits:
registers, spills (the stack frame), shared memory (227 KiB per program on an H100, 99 KiB
on an RTX 4090). Builds each kernel for the head dims and dtypes of the plans, with and
without sink and dropout, as a launch on contiguous tensors specializes it, prints each
one's resources, and exits non-zero where a build fails or its shared memory does not fit.

    TRITON_INTERPRET=0 python tests/local_arch_build.py [--quick | --smoke] [--arch sm_86]
"""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arch_build import TRITON_TYPES, report, target  # noqa: E402

from timm_flashwin.ops.dispatch import direct_launches  # noqa: E402
from timm_flashwin.kernels.local import plan as local_plan  # noqa: E402
from timm_flashwin.kernels.local.bias import DECOMPOSED, NO_BIAS  # noqa: E402
from timm_flashwin.kernels.arch import KNOWN, Arch  # noqa: E402
from timm_flashwin.kernels.sizes import tile_side  # noqa: E402
from timm_flashwin.kernels.launcher import compiler_options  # noqa: E402
from timm_flashwin.kernels.local.backward import local_attention_bwd_dkdv_kernel, local_attention_bwd_dq_kernel  # noqa: E402,E501
from timm_flashwin.kernels.local.forward import local_attention_fwd_kernel  # noqa: E402

#: integer arguments a launch specializes to the constant 1 where they are 1 (Triton does so
#: for any integer not in a kernel's do_not_specialize): S_q = S_k = 1 with one head; and "period",
#: which stands for a sliding window here (PERIODIC False: the kernels make it the constant 1)
SLIDING = ("period",)
ALL_ONE = ("S_q", "S_k", "H", "H_kv", "period")
#: (head_dim, dtype, sink, dropout, the integer arguments that are 1)
CASES = [
    (64, torch.bfloat16, False, False, SLIDING),
    (128, torch.bfloat16, False, False, ()),
    (128, torch.float16, True, True, ()),
    (256, torch.bfloat16, False, False, SLIDING),
    (96, torch.bfloat16, True, False, ()),
    (8, torch.float16, False, False, ALL_ONE),
    (64, torch.float32, False, False, ()),
    (128, torch.float32, True, False, SLIDING),
    (256, torch.float32, False, False, ()),
]
QUICK = [CASES[0], CASES[1], CASES[2], CASES[3], CASES[5], CASES[6]]
#: decomposed relative-position biases (kernels/local/bias.py), global attention:
#: (head_dim, dtype, dropout, key grid (key_h, key_w)): SAM's global blocks at 1024 px (ViT-B/L,
#: ViT-H) and 2048 px (row tiles), its 14 x 14 windows and a 40 x 40 grid (gathered)
BIAS_CASES = [
    (64, torch.bfloat16, False, (64, 64)),
    (80, torch.bfloat16, False, (64, 64)),
    (64, torch.bfloat16, True, (64, 64)),
    (64, torch.bfloat16, False, (128, 128)),
    (64, torch.bfloat16, False, (14, 14)),
    (80, torch.float16, False, (14, 14)),
    (64, torch.bfloat16, False, (40, 40)),
    (64, torch.float32, False, (64, 64)),
    (64, torch.float32, False, (14, 14)),
    (80, torch.float32, False, (14, 14)),
]
#: the one case of the test suite (tests/test_local_plans.py): every constexpr branch, and
#: at head_dim 64 the forward plans of short, long and tall rows differ (three builds)
SMOKE = [(64, torch.float16, True, True, SLIDING)]
POINTERS_IN_DTYPE = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "dout_ptr", "dq_ptr", "dk_ptr", "dv_ptr"}
#: the decomposed bias's terms and gradients: in the inputs' dtype, as SAM's einsum gives them
BIAS_POINTERS = {"rel_h_ptr", "rel_w_ptr", "d_rel_h_ptr", "d_rel_w_ptr"}


def signature(kernel, dtype: torch.dtype, constexprs: dict, ones=()):
    ones = [name for name in ones if name not in kernel.do_not_specialize]
    """(types, constexprs, attrs) as a launch on contiguous (B, H, S, D) tensors specializes
    them: the head dim's stride 1 a constant, pointers 16-byte aligned, ``ones`` constants."""
    types, constexprs = {}, dict(constexprs)
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ones:
            types[name], constexprs[name] = "constexpr", 1
        elif (name.startswith("stride_") and name.endswith("d")) or name in ("stride_hk", "stride_wk"):
            types[name], constexprs[name] = "constexpr", 1  # contiguous last dims (the bias's: LocalInputs)
        elif name == "seed_ptr":
            types[name] = "*i64"
        elif name == "counts_ptr":
            types[name] = "*i32"
        elif name in BIAS_POINTERS and constexprs.get("BIAS", NO_BIAS) == NO_BIAS:
            types[name], constexprs[name] = "constexpr", None  # a launch without a bias passes None
        elif name.endswith("_ptr"):
            types[name] = "*" + (TRITON_TYPES[dtype] if name in POINTERS_IN_DTYPE | BIAS_POINTERS else "fp32")
        elif name in ("qk_scale", "scale", "dropout_p"):
            types[name] = "fp64"  # as torch.compile passes Python floats (a launch: fp32)
        else:
            types[name] = "i32"
    aligned_rows = constexprs["D"] % 16 == 0  # rows of D elements: strides that are multiples of 16
    # the bias's strides: the rows of its terms hold key_h or key_w elements (14: not aligned)
    aligned = {"h": constexprs.get("KEY_H", 16) % 16 == 0, "w": constexprs.get("KEY_W", 16) % 16 == 0}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if types[name] != "constexpr" and (name.endswith("_ptr") or (
                 name.startswith("stride_") and aligned.get(name[7], aligned_rows) and name[7:] not in ("hk", "wk")))}
    for name in ("KEY_H", "KEY_W"):
        constexprs.pop(name, None)
    return types, constexprs, attrs


def build(kernel, dtype: torch.dtype, constexprs: dict, warps: int, stages: int, arch: Arch, ones=()) -> bool:
    types, constexprs, attrs = signature(kernel, dtype, constexprs, ones)
    source = ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs)
    with direct_launches():
        options = dict(compiler_options(warps), num_stages=stages)
    compiled = triton.compile(source, target=target(arch), options=options)
    return report(kernel.fn.__name__, compiled, arch) <= arch.shared_memory


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    arch = KNOWN[sys.argv[sys.argv.index("--arch") + 1]] if "--arch" in sys.argv else KNOWN["sm_90"]
    ok = True
    if "--bias" in sys.argv:
        return 0 if build_bias_cases(arch) else 1
    cases = QUICK if "--quick" in sys.argv else SMOKE if "--smoke" in sys.argv else CASES
    for head_dim, dtype, sink, dropout, ones in cases:
        print(f"D={head_dim} {TRITON_TYPES[dtype]}{' sink' if sink else ''}{' dropout' if dropout else ''}"
              f"{' ' + '=1, '.join(ones) + '=1' if ones else ''}")
        flags = dict(D=head_dim, BLOCK_D=tile_side(head_dim), PERIODIC="period" not in ones,
                     HAS_SINK=sink, HAS_DROPOUT=dropout, PRECISION=local_plan.precision(dtype), COUNT_TILES=False,
                     BIAS=NO_BIAS, ROW_TILE=False, KEY_H_PAD=16, KEY_W_PAD=16)
        for kind, kernel in (("fwd", local_attention_fwd_kernel), ("dkdv", local_attention_bwd_dkdv_kernel),
                             ("dq", local_attention_bwd_dq_kernel)):
            # the plans of every class of rows (local_plan.row_class), each once; but for the
            # suite's smoke case, also fitted to short sequences (local_plan.fitted: 4 and 16
            # queries against 16 and 64 keys, Hiera's pooling blocks)
            classes = (local_plan.SHORT, local_plan.LONG, local_plan.TALL)
            plans = [local_plan.plan(kind, head_dim, dtype, rows, arch=arch) for rows in classes]
            if cases is not SMOKE:
                plans += [local_plan.plan(kind, head_dim, dtype, local_plan.SHORT, *lengths, arch=arch)
                          for lengths in ((4, 16), (16, 64))]
            for tiles in dict.fromkeys(plans):
                # the forward as a positive scale builds it (local_plan.fold_scale)
                fwd_flags = dict(FOLD_SCALE=local_plan.fold_scale(1.0, head_dim)) if kind == "fwd" else {}
                ok &= build(kernel, dtype, dict(flags, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **fwd_flags),
                            tiles.num_warps, tiles.num_stages, arch, ones)
    return 0 if ok else 1


def build_bias_cases(arch: Arch) -> bool:
    """Each kernel of every ``BIAS_CASES`` case, as ``local_plan.call_plan`` plans a batch-4,
    12-head call of it on ``arch``."""
    ok = True
    for head_dim, dtype, dropout, (key_h, key_w) in BIAS_CASES:
        keys = key_h * key_w
        call = local_plan.LocalCall(4, 12, 12, keys, keys, head_dim, dtype, arch, (1, -1, -1, 0), dropout, True,
                                    DECOMPOSED, key_h, key_w)
        print(f"D={head_dim} {TRITON_TYPES[dtype]}{' dropout' if dropout else ''} decomposed bias {key_h}x{key_w}")
        plan = local_plan._call_plan(call, False)
        for kernel, kernel_plan in ((local_attention_fwd_kernel, plan.fwd), (local_attention_bwd_dq_kernel, plan.dq),
                                    (local_attention_bwd_dkdv_kernel, plan.dkdv)):
            kwargs = dict(kernel_plan.kwargs)
            warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
            kwargs.pop("enable_fp_fusion", None)
            ok &= build(kernel, dtype, dict(kwargs, KEY_H=key_h, KEY_W=key_w), warps, stages, arch, SLIDING)
    return ok


if __name__ == "__main__":
    sys.exit(main())
