"""A short AMP training run, patched and unpatched side by side: the losses match.

    python examples/train_amp.py [--model swin_tiny_patch4_window7_224] [--steps 20]
    python examples/train_amp.py --steps 5 --batch 4 --img-size 56                    # a CPU, under a minute
    TRITON_INTERPRET=1 python examples/train_amp.py --steps 2 --batch 1 --img-size 56  # the kernels on a CPU (slow)

Both copies start from the same weights and see the same batches (a fixed synthetic
classification task), one step of each in turn; the patched copy's per-step losses must
stay within tolerance of timm's. On a GPU: bfloat16 autocast, float32 weights, AdamW. On a
CPU the same loop runs in float32 (bfloat16 autocast on CPU too, with --amp-on-cpu)
through PyTorch's math (no speedup there), or through the kernels under Triton's
interpreter with TRITON_INTERPRET=1 (slow: the small setting above).
"""
import argparse
import copy
import sys
from typing import List, Optional

import timm
import torch
from torch import nn

import timm_flashwin


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224", help="timm model name")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each copy")
    parser.add_argument("--batch", type=int, default=16, help="images per step")
    parser.add_argument("--img-size", type=int, default=224 if torch.cuda.is_available() else 112,
                        help="image side in pixels (224 on a GPU, 112 on a CPU)")
    parser.add_argument("--amp-on-cpu", action="store_true", help="bfloat16 autocast on a CPU too")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = device == "cuda" or args.amp_on_cpu
    img_size = args.img_size
    print(f"building {args.model} at {img_size}x{img_size} on {device}", flush=True)
    torch.manual_seed(0)
    timm_model = timm.create_model(args.model, img_size=img_size, num_classes=10, drop_path_rate=0.0).to(device)
    patched = timm_flashwin.patch_model(copy.deepcopy(timm_model))
    report = timm_flashwin.patch_report(patched)
    print(f"{report.summary()}; {report.road_line()}", flush=True)  # what computes the patched attention

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, img_size, img_size, generator=gen),
             torch.randint(0, 10, (args.batch,), generator=gen)) for _ in range(4)]
    models = {"timm": timm_model, "flashwin": patched}
    optimizers = {name: torch.optim.AdamW(model.train().parameters(), lr=3e-4) for name, model in models.items()}
    tolerance = 5e-2 if amp else 1e-3
    worst = 0.0
    for step in range(args.steps):
        x, y = (t.to(device) for t in data[step % len(data)])
        losses = {}
        for name, model in models.items():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name] = loss.item()
        worst = max(worst, abs(losses["timm"] - losses["flashwin"]) / max(abs(losses["timm"]), 1.0))
        print(f"step {step + 1:3d}/{args.steps}  timm {losses['timm']:.4f}  flashwin {losses['flashwin']:.4f}", flush=True)
    if not worst <= tolerance:
        sys.exit(f"losses differ by {worst:.1e} (> {tolerance})")
    print(f"losses match within {tolerance} (largest difference {worst:.1e}; {device}, "
          f"{'bf16 autocast' if amp else 'float32'})")


if __name__ == "__main__":
    main()
