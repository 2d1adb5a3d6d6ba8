"""Would tensor-descriptor loads or Triton's warp specialization speed up window 16's forward?

    python benchmarks/probe_warp_specialize.py --out results/probe_tma_ws.json

A plain FlashAttention forward of window 16's shape (512, 3, 256, 32), bf16, with a float16
bias of 16 mask windows (the mask folded in, as ``launch.streamed_bias`` reads it), no
statistics: q, k, v and bias loaded through pointers (TMA=0) or through tensor descriptors
(``tl.make_tensor_descriptor``, TMA=1), the key-block loop (WS=1) or the window loop (WS=2)
marked ``warp_specialize=True`` (Triton 3.6 partitions such loops on sm_90 only with
descriptor loads), over tiles, warps, stages and programs per SM. Each output is checked
against PyTorch; then the op's own forward (no gradient, a shift mask) is timed in the same
process (CUDA-graph replays). GPU only (sm_90).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timm_flashwin import window_attention  # noqa: E402

B, H, N, D, NW = 512, 3, 256, 32, 16  # windows, heads, tokens, head dim, mask windows


@triton.jit
def probe_fwd_kernel(qkv_ptr, bias_ptr, out_ptr, B, windows_per_program, scale2,
                     H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, NW: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """One (query block, head, mask window, run of windows) per program; log2-domain logits."""
    pid = tl.program_id(0)
    m_block = pid % (N // BLOCK_M)
    h = (pid // (N // BLOCK_M)) % H
    chunk = pid // (N // BLOCK_M) // H
    w = chunk % NW  # the windows w + NW * i share a bias tile set
    first = (chunk // NW) * windows_per_program
    last = tl.minimum(first + windows_per_program, B // NW)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    if TMA:
        q_desc = tl.make_tensor_descriptor(qkv_ptr, shape=[B, N, 3 * H * D], strides=[N * 3 * H * D, 3 * H * D, 1],
                                           block_shape=[1, BLOCK_M, D])
        kv_desc = tl.make_tensor_descriptor(qkv_ptr, shape=[B, N, 3 * H * D], strides=[N * 3 * H * D, 3 * H * D, 1],
                                            block_shape=[1, BLOCK_N, D])
        bias_desc = tl.make_tensor_descriptor(bias_ptr, shape=[NW * H, N, N], strides=[N * N, N, 1],
                                              block_shape=[1, BLOCK_M, BLOCK_N])
    for i in tl.range(first, last, warp_specialize=WS == 2):
        b = w + i * NW
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        base = qkv_ptr + b.to(tl.int64) * N * 3 * H * D
        if TMA:
            q = q_desc.load([b, m_block * BLOCK_M, h * D]).reshape(BLOCK_M, D)
        else:
            q = tl.load(base + rows[:, None] * 3 * H * D + h * D + dims[None, :])
        for start in tl.range(0, N, BLOCK_N, warp_specialize=WS == 1):
            if TMA:
                k = kv_desc.load([b, start, (H + h) * D]).reshape(BLOCK_N, D)
                v = kv_desc.load([b, start, (2 * H + h) * D]).reshape(BLOCK_N, D)
                bias = bias_desc.load([w * H + h, m_block * BLOCK_M, start]).reshape(BLOCK_M, BLOCK_N)
            else:
                k = tl.load(base + (start + cols)[:, None] * 3 * H * D + (H + h) * D + dims[None, :])
                v = tl.load(base + (start + cols)[:, None] * 3 * H * D + (2 * H + h) * D + dims[None, :])
                bias = tl.load(bias_ptr + (w * H + h) * N * N + rows[:, None] * N + (start + cols)[None, :])
            z = tl.fma(tl.dot(q, tl.trans(k)), scale2, bias.to(tl.float32))
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(z - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m = m_new
        out = acc * (1.0 / l)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * N * H * D + rows[:, None] * H * D + h * D + dims[None, :],
                 out.to(tl.bfloat16))


def _scratch(size: int, alignment: int, stream):  # device-side tensor descriptors take scratch memory
    return torch.empty(size, device="cuda", dtype=torch.int8)


def bench_us(fn) -> float:
    """Event-timed launches: GPU time where a launch's host time is shorter than its kernel
    (the probe kernels, 90 us and more)."""
    return triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3


def graph_bench_us(fn) -> float:
    """CUDA-graph replays: GPU time also where the host takes longer than the kernels (the
    op's forward: its launcher's host time can exceed the kernel's on a slow host)."""
    return triton.testing.do_bench_cudagraph(fn, rep=300) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    triton.set_allocator(_scratch)
    torch.manual_seed(0)
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    bias = (torch.randn(NW * H, N, N, device="cuda") * 2).half()  # log2-domain, mask folded in
    out = torch.empty(B, N, H * D, device="cuda", dtype=torch.bfloat16)
    scale2 = D ** -0.5 * 1.4426950408889634
    q, k, v = qkv.view(B, N, 3, H, D).permute(2, 0, 3, 1, 4).float()
    logits2 = q @ k.transpose(-1, -2) * scale2 + bias.float().view(NW, H, N, N).repeat(B // NW, 1, 1, 1)
    expected = (torch.softmax(logits2 * 0.6931471805599453, -1) @ v).transpose(1, 2).reshape(B, N, H * D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    tiles = ((64, 64, 4), (64, 128, 4), (128, 128, 8), (128, 64, 8))
    variants = itertools.product((0, 1), (0, 1, 2), tiles, (2, 3), (2, 4))
    for tma, ws, (block_m, block_n, warps), stages, per_sm in variants:
        if ws and not tma:
            continue  # pointer loads with the mark crash Triton 3.6's warp-specialization pass
        base_programs = (N // block_m) * H * NW
        per_program = max(1, -(-(B // NW) * base_programs // (sms * per_sm)))
        grid = (base_programs * -(-(B // NW) // per_program),)
        name = f"tma{tma} ws{ws} {block_m}x{block_n} w{warps} s{stages} pps{per_sm}"

        def launch():
            probe_fwd_kernel[grid](qkv, bias, out, B, per_program, scale2, H=H, N=N, D=D, NW=NW, BLOCK_M=block_m,
                                   BLOCK_N=block_n, TMA=tma, WS=ws, num_warps=warps, num_stages=stages)
        try:
            out.zero_()
            launch()
            torch.cuda.synchronize()
            error = (out.float() - expected).abs().max().item()
            results[name] = (bench_us(launch), error)
        except Exception as exc:  # a configuration the compiler rejects
            print(name, "failed:", str(exc).splitlines()[0][:150] if str(exc) else type(exc).__name__, flush=True)
            continue
        print(f"{name}: {results[name][0]:.1f} us, max error {error:.3g}", flush=True)
    mask = torch.zeros(NW, N, N, device="cuda")
    mask[5:, :100, 100:] = -100.0
    dense_bias = torch.randn(H, N, N, device="cuda")
    with torch.no_grad():
        ours = graph_bench_us(lambda: window_attention(qkv, H, bias=dense_bias, mask=mask, scale=D ** -0.5))
    results["timm_flashwin forward (no gradient, whole op)"] = (ours, 0.0)
    print(f"timm_flashwin forward (no gradient, whole op): {ours:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
