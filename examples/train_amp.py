"""A short AMP training run, patched and unpatched side by side: the losses match.

    python examples/train_amp.py [--model swin_tiny_patch4_window7_224] [--steps 20]

Both copies start from the same weights and see the same batches (a fixed synthetic
classification task); the patched copy's per-step losses must stay within tolerance of
timm's. On a GPU: bfloat16 autocast, float32 weights, AdamW. On a CPU the same loop runs
in float32 (bfloat16 autocast on CPU too, with --amp-on-cpu) through PyTorch's path.
"""
import argparse
import copy

import timm
import torch
from torch import nn

import timm_flashwin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=None, help="default: 224 on a GPU, 112 on a CPU")
    parser.add_argument("--amp-on-cpu", action="store_true")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = device == "cuda" or args.amp_on_cpu
    img_size = args.img_size or (224 if device == "cuda" else 112)
    torch.manual_seed(0)
    timm_model = timm.create_model(args.model, img_size=img_size, num_classes=10, drop_path_rate=0.0).to(device)
    patched = timm_flashwin.patch_model(copy.deepcopy(timm_model))

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, img_size, img_size, generator=gen),
             torch.randint(0, 10, (args.batch,), generator=gen)) for _ in range(4)]
    losses = {}
    for name, model in (("timm", timm_model), ("flashwin", patched)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        model.train()
        losses[name] = []
        for step in range(args.steps):
            x, y = (t.to(device) for t in data[step % len(data)])
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    tol = 5e-2 if amp else 1e-3
    for step, (a, b) in enumerate(zip(losses["timm"], losses["flashwin"])):
        print(f"step {step:3d}  timm {a:.4f}  flashwin {b:.4f}")
        assert abs(a - b) <= tol * max(abs(a), 1.0), f"step {step}: losses differ beyond {tol}"
    print(f"losses match within {tol} ({device}, {'bf16 autocast' if amp else 'float32'})")


if __name__ == "__main__":
    main()
