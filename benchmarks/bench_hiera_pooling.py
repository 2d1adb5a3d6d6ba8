"""Hiera's q-pooling attention modules alone: timm's forward against the patched one, forward +
backward, side by side in alternating rounds.

    python benchmarks/bench_hiera_pooling.py --batch 256 --out results/hiera_pooling.json

The three ``MaskUnitAttention`` modules of hiera_tiny_224 with ``q_stride`` > 1 (mask units
of 64 keys and 16 pooled queries; of 16 keys and 4; global, 196 keys and 49), in bfloat16
on the GPU, each given its input x (B, N, C) and a fixed output gradient. Variants:

* ``timm``: the module's own forward (SDPA; on 5-D tensors for the mask units);
* ``patched``: ``HieraAdapter.forward``, the pooled queries through the local operator on
  views of qkv (``adapters/hiera.py``);
* ``padded``: the path the adapter took before (commit 6e57c5b): the pooled queries
  zero-padded to t rows in a stacked copy of q, k and v through ``window_attention``.

Columns: ms per forward + backward (median over the rounds; 20 calls a round, a batch of 256
keeps the GPU busy, 64 is host-bound), the memory the forward leaves for the backward
(``saved MiB``) and the output's largest error relative to timm's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, gpu_ms_per_call, write_json  # noqa: E402
from timm_flashwin.patching.adapters.hiera import HieraAdapter  # noqa: E402
from timm_flashwin.ops.window import window_attention  # noqa: E402

#: the tokens each pooling module of hiera_tiny_224 takes at 224 x 224
TOKENS = {"blocks.1.attn": 3136, "blocks.3.attn": 784, "blocks.10.attn": 196}


class PaddedQueries(HieraAdapter):
    """The adapter's path before commit 6b5b783, kept to compare against."""

    def _attention(self, module, x, bias, mask, dropout_p, grid=None):
        qkv = self.qkv(module, x)
        windows, tokens, _ = qkv.shape
        q, k, v = qkv.view(windows, tokens, 3, module.heads, module.head_dim).unbind(2)
        pooled = q.view(windows, module.q_stride, tokens // module.q_stride, module.heads, module.head_dim).amax(1)
        q = torch.cat([pooled, pooled.new_zeros((windows, tokens - pooled.shape[1]) + pooled.shape[2:])], 1)
        out = window_attention(torch.stack([q, k, v], 2), module.heads, scale=float(module.scale))
        return out[:, :tokens // module.q_stride]


def time_rounds(variants: Dict[str, Callable], x: torch.Tensor, grad: torch.Tensor, rounds: int, calls: int):
    """{variant: [ms per forward + backward, one per round]}, the variants alternating."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, forward in variants.items():
            times[name].append(gpu_ms_per_call(lambda: forward(x).backward(grad), calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import timm
    model = timm.create_model("hiera_tiny_224").cuda().to(torch.bfloat16)
    patched, padded = HieraAdapter(), PaddedQueries()
    rows = []
    print(f"{'module':16s} {'variant':8s} {'ms':>8s} {'saved MiB':>10s} {'rel err':>8s}")
    for name, module in ((n, m) for n, m in model.named_modules() if n in TOKENS):
        variants = {"timm": module, "patched": lambda t, m=module: patched.forward(m, t),
                    "padded": lambda t, m=module: padded.forward(m, t)}
        x = torch.randn(args.batch, TOKENS[name], module.qkv.in_features, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        expected = module(x).float()
        grad = torch.randn_like(expected).to(torch.bfloat16)
        saved, errors = {}, {}
        for variant, forward in variants.items():
            for _ in range(3):  # warm-up: builds, host programs recorded
                forward(x).backward(grad)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = forward(x)
            saved[variant] = (torch.cuda.memory_allocated() - before) / 2 ** 20
            errors[variant] = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            out.backward(grad)
            del out
        times = time_rounds(variants, x, grad, args.rounds, 20)
        for variant in variants:
            row = dict(module=name, x=list(x.shape), variant=variant, ms=statistics.median(times[variant]),
                       ms_rounds=times[variant], saved_mib=saved[variant], rel_err=errors[variant],
                       device=torch.cuda.get_device_name(), torch=torch.__version__, code=code_version())
            rows.append(row)
            print(f"{name:16s} {variant:8s} {row['ms']:8.3f} {row['saved_mib']:10.1f} {row['rel_err']:8.4f}",
                  flush=True)
        if args.out:
            write_json(args.out, rows)


if __name__ == "__main__":
    main()
