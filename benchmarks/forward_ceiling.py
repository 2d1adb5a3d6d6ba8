"""How fast can a Triton forward of long-row attention be on this GPU and Triton, and
where do our local operator and FlexAttention stand against it?

    python benchmarks/forward_ceiling.py --out results/forward_ceiling.json   # ~5 min on an H100

The ceiling is measured, not argued: a minimal global-attention forward (no mask, no
partial blocks: S a multiple of 128, no statistics saved, the output only), compiled in
every configuration below, its best taken. What it does per key block is what any flash
forward must do (two matmuls, the online softmax); what it leaves out (masks, edge
blocks, the row statistics a backward needs) only makes it faster. Three ways to load:

* pointers         tl.load of the K and V blocks (what our kernels and Flex's do)
* tma              tensor descriptors made on the device (Hopper's bulk-copy engine;
                   ``triton.set_allocator`` gives the descriptors their scratch memory)
* warp specialize  either, with ``tl.range(..., warp_specialize=True)``: Triton splits
                   the loop into producer and consumer warps (its Hopper support is new)

Against: ``timm_flashwin.sliding_window_attention`` with ``window=(None, None)`` (our global
attention), FlexAttention (torch.compile'd, no block mask) and
``F.scaled_dot_product_attention`` (PyTorch's choice of fused kernel, not Triton), all
forward only, without a gradient, bf16, ``triton.testing.do_bench``. A configuration
whose output is off (relative to SDPA's, max |diff| > 0.05) is reported and not taken.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, write_json  # noqa: E402
from timm_flashwin import sliding_window_attention  # noqa: E402

#: (head_dim, B, H, S)
SHAPES = ((64, 1, 12, 16384), (128, 1, 16, 16384), (64, 2, 16, 8192))
#: per load kind: BLOCK_M, BLOCK_N, warps, stages
CONFIGS = list(itertools.product((128,), (64, 128), (4, 8), (2, 3)))
LOADS = {"pointers": (False, False), "tma": (True, False), "pointers+ws": (False, True), "tma+ws": (True, True)}
#: warp specialization with 4 warps is left out: on an H100 with Triton 3.6 it failed to
#: build with pointer loads and with TMA gave wrong outputs (max |diff| 0.1, NaN) and once
#: an illegal memory access that ended the process (2026-11-28)
WS_MIN_WARPS = 8


@triton.jit
def global_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qk_scale, S, H,
                          stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid (S // BLOCK_M, B * H); q, k, v, out (B, H, S, D) with unit stride in D."""
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    keys = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q_head = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
    k_head = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
    v_head = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
    if TMA:
        q_desc = tl.make_tensor_descriptor(q_head, shape=[S, D], strides=[stride_qs, 1], block_shape=[BLOCK_M, D])
        k_desc = tl.make_tensor_descriptor(k_head, shape=[S, D], strides=[stride_ks, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_head, shape=[S, D], strides=[stride_vs, 1], block_shape=[BLOCK_N, D])
        q = q_desc.load([m0, 0])
    else:
        q = tl.load(q_head + rows[:, None] * stride_qs + dims[None, :])
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in tl.range(0, S, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        if TMA:
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
        else:
            k = tl.load(k_head + (n0 + keys)[:, None] * stride_ks + dims[None, :])
            v = tl.load(v_head + (n0 + keys)[:, None] * stride_vs + dims[None, :])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             out.to(out_ptr.dtype.element_ty))


def minimal_forward(q, k, v, block_m, block_n, warps, stages, tma, warp_specialize):
    """A call of ``global_forward_kernel`` in one configuration, and its output tensor."""
    batch, heads, seq, head_dim = q.shape
    out = torch.empty_like(q)
    qk_scale = head_dim ** -0.5 * 1.4426950408889634

    def call():
        global_forward_kernel[(seq // block_m, batch * heads)](
            q, k, v, out, qk_scale, seq, heads, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, WARP_SPECIALIZE=warp_specialize,
            num_warps=warps, num_stages=stages)
    return call, out


def measure(shape, flex) -> dict:
    head_dim, batch, heads, seq = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v)
    flops = 4 * batch * heads * seq * seq * head_dim
    rows, best = [], {}
    for (load, (tma, ws)), (block_m, block_n, warps, stages) in itertools.product(LOADS.items(), CONFIGS):
        if ws and warps < WS_MIN_WARPS:
            continue
        config = dict(block_m=block_m, block_n=block_n, warps=warps, stages=stages)
        try:
            call, out = minimal_forward(q, k, v, block_m, block_n, warps, stages, tma, ws)
            call()
            error = (out.float() - reference.float()).abs().max().item()
            ms = do_bench(call, warmup=25, rep=100)
        except Exception as exc:  # noqa: BLE001 (a configuration Triton cannot build is a result)
            rows.append(dict(load=load, **config, error=str(exc).splitlines()[0][:200]))
            continue
        row = dict(load=load, **config, ms=ms, tflops=flops / ms / 1e9, max_abs_diff=error)
        rows.append(row)
        if error <= 0.05 and (load not in best or ms < best[load]["ms"]):
            best[load] = row
    with torch.no_grad():
        for name, fn in (("ours", lambda: sliding_window_attention(q, k, v)), ("flex", lambda: flex(q, k, v)),
                         ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v))):
            ms = do_bench(fn, warmup=25, rep=100)
            best[name] = dict(ms=ms, tflops=flops / ms / 1e9)
    return dict(head_dim=head_dim, batch=batch, heads=heads, seq=seq, best=best, configs=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=int, default=list(range(len(SHAPES))), metavar="I",
                        help=f"which of SHAPES (head_dim, B, H, S) to measure, by index: {SHAPES}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention
    # the descriptors' scratch memory (a few hundred bytes a program), from torch's allocator
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    flex = torch.compile(flex_attention, dynamic=False)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                code=code_version())
    results = []
    for index in args.shapes:
        result = measure(SHAPES[index], flex)
        results.append(result)
        fastest_first = sorted(result["best"].items(), key=lambda item: -item[1]["tflops"])
        print(f"D {result['head_dim']} B {result['batch']} H {result['heads']} S {result['seq']}: "
              + ", ".join(f"{name} {row['tflops']:.0f}" for name, row in fastest_first) + " TFLOP/s", flush=True)
        if args.out:
            write_json(args.out, dict(meta=meta, results=results))


if __name__ == "__main__":
    main()
