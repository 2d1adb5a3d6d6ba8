"""A small autoregressive frame model trained with the local-attention operators; its
losses match the same model computing attention with the PyTorch reference.

    python examples/train_local.py [--steps 20] [--frames 16] [--frame-tokens 64]
    python examples/train_local.py --steps 8 --frames 8 --frame-tokens 32 --dim 64   # a CPU, under a minute
    TRITON_INTERPRET=1 python examples/train_local.py --steps 4 --frames 5 --frame-tokens 12 --local 20 \
        --dim 32 --layers 1   # the kernels on a CPU, under Triton's interpreter (slow: small sizes)

A "video" is a sequence of frames of ``--frame-tokens`` tokens each (a 1-D signal per token,
embedded); the model predicts every token of frame t + 1 from frames up to t. Each layer
attends with ``block_sliding_window_attention`` (a frame sees itself and the
``--window - 1`` frames before it, plus the first ``--sinks`` tokens of the video), then
with ``sliding_window_attention`` over a causal local window of tokens (``--local``),
grouped-query heads in both. Two copies start from the same weights and see the same
batches, one step of each in turn; one takes our operators, the other
``local_attention_reference`` (dense masks, PyTorch's autograd). On a GPU in bfloat16
autocast, else float32 (on a CPU the operators compute in PyTorch unless TRITON_INTERPRET=1;
the first line says which). It exits 1 unless the two copies' losses match at every step and
on the first step's videos after training, and training lowered that loss (at any --steps).
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from typing import List, Optional

import torch
from torch import nn

import timm_flashwin
from timm_flashwin.ops.dispatch import road_name
from timm_flashwin.ops.local_reference import block_window_visible, local_attention_reference, sliding_window_visible


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, pattern: dict, fused: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.pattern, self.fused = pattern, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # (B, H, S, D), strided views
        k, v = self.kv(x).view(B, S, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.pattern
        if self.fused and "block_size" in p:
            out = timm_flashwin.block_sliding_window_attention(q, k, v, **p)
        elif self.fused:
            out = timm_flashwin.sliding_window_attention(q, k, v, window=p["window"], causal=True)
        elif "block_size" in p:
            out = local_attention_reference(q, k, v, block_window_visible(**p))
        else:
            out = local_attention_reference(q, k, v, sliding_window_visible(p["window"][0], 0))
        return self.proj(out.transpose(1, 2).reshape(B, S, -1))


class FrameModel(nn.Module):
    def __init__(self, args, fused: bool):
        super().__init__()
        dim = args.dim
        self.embed = nn.Linear(1, dim)
        self.position = nn.Parameter(torch.randn(args.frames * args.frame_tokens, dim) * 0.02)
        frames = dict(block_size=args.frame_tokens, window_blocks=args.window, sink_tokens=args.sinks)
        tokens = dict(window=(args.local, 0))
        self.layers = nn.ModuleList()
        for pattern in (frames, tokens) * args.layers:
            self.layers.append(nn.ModuleDict(dict(
                norm=nn.LayerNorm(dim), attn=Attention(dim, args.heads, args.kv_heads, pattern, fused),
                norm2=nn.LayerNorm(dim), mlp=nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)))))
        self.head = nn.Linear(dim, 1)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """video (B, S, 1) -> the prediction of every token one frame later (B, S, 1)."""
        x = self.embed(video) + self.position[:video.shape[1]]
        for layer in self.layers:
            x = x + layer["attn"](layer["norm"](x))
            x = x + layer["mlp"](layer["norm2"](x))
        return self.head(x)


def videos(batch: int, args, generator: torch.Generator) -> torch.Tensor:
    """Frames of waves drifting from frame to frame: (B, frames * frame_tokens, 1)."""
    t = torch.arange(args.frames)[:, None]
    n = torch.arange(args.frame_tokens)[None, :]
    freq = torch.rand(batch, 1, 1, generator=generator) * 3 + 1
    phase = torch.rand(batch, 1, 1, generator=generator) * 2 * math.pi
    wave = torch.sin(freq * (n / args.frame_tokens * 2 * math.pi + 0.3 * t) + phase)
    return (wave + 0.05 * torch.randn(wave.shape, generator=generator)).reshape(batch, -1, 1)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=20, help="training steps of each copy")
    parser.add_argument("--batch", type=int, default=4, help="videos per step")
    parser.add_argument("--frames", type=int, default=16, help="frames per video")
    parser.add_argument("--frame-tokens", type=int, default=64, help="tokens per frame")
    parser.add_argument("--window", type=int, default=4, help="frames a frame sees, its own included")
    parser.add_argument("--sinks", type=int, default=8, help="first tokens of the video every token sees")
    parser.add_argument("--local", type=int, default=96, help="earlier tokens of the causal token window")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key and value heads")
    parser.add_argument("--layers", type=int, default=2, help="pairs of attention layers (frames, then tokens)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = device == "cuda"
    torch.manual_seed(0)
    reference = FrameModel(args, fused=False).to(device)
    fused = copy.deepcopy(reference)
    for module in fused.modules():
        if isinstance(module, Attention):
            module.fused = True
    gen = torch.Generator().manual_seed(0)
    data = [videos(args.batch, args, gen) for _ in range(4)]
    step_tokens = args.frame_tokens
    models = {"reference": reference, "flashwin": fused}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    # the learning rate warmed up over 10 steps: Adam's first steps move every weight by about
    # the full rate, which at 1e-3 sent the loss up before it came down
    schedules = {name: torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 10))
                 for name, o in optimizers.items()}
    losses = {name: [] for name in models}
    tolerance = 2e-2 if amp else 1e-4

    def loss_of(model: nn.Module, video: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            prediction = model(video[:, :-step_tokens])
        return nn.functional.mse_loss(prediction.float(), video[:, step_tokens:])

    first = data[0].to(device)  # the first step's videos: their loss before and after training

    def first_batch_losses() -> dict:
        with torch.no_grad():
            return {name: loss_of(model, first).item() for name, model in models.items()}
    before = first_batch_losses()
    print(f"{args.steps} steps of {args.batch} videos of {args.frames * args.frame_tokens} tokens on {device}; "
          f"attention: {road_name(torch.device(device), torch.bfloat16 if amp else torch.float32)}", flush=True)
    print(f"{'step':>4s} {'reference':>12s} {'flashwin':>12s} {'rel. diff':>10s}", flush=True)
    for step in range(args.steps):
        video = data[step % len(data)].to(device)
        for name, model in models.items():
            loss = loss_of(model, video)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            schedules[name].step()
            losses[name].append(loss.item())
        a, b = losses["reference"][-1], losses["flashwin"][-1]
        print(f"{step:4d} {a:12.6f} {b:12.6f} {abs(a - b) / abs(a):10.2e}", flush=True)
    after = first_batch_losses()
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["reference"] + [after["reference"]],
                                                     losses["flashwin"] + [after["flashwin"]]))
    if not worst <= tolerance:
        sys.exit(f"losses differ by {worst:.2e} (> {tolerance:.0e})")
    # trained: the first step's videos have a lower loss after the steps than before them (the
    # steps' own losses are of other batches from the second step on)
    if not after["flashwin"] < before["flashwin"]:
        sys.exit(f"training did not lower the loss on the first step's videos ({before['flashwin']:.4f} -> "
                 f"{after['flashwin']:.4f})")
    print(f"losses match (largest relative difference {worst:.2e} <= {tolerance:.0e}); the first step's videos: "
          f"loss {before['flashwin']:.4f} -> {after['flashwin']:.4f} after training")

if __name__ == "__main__":
    main()
