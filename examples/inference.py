"""One-line patching for inference.

    python examples/inference.py [--model swinv2_tiny_window8_256] [--batch 8]

Builds a timm model (random weights unless --pretrained), patches it with one call and
checks that the patched model predicts what the unpatched one does. On a GPU it runs in
bfloat16 with the Triton kernels; on a CPU it runs the same semantics in PyTorch (set
TRITON_INTERPRET=1 to run the kernels there, slowly).
"""
import argparse
import copy

import timm
import torch

import timm_flashwin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="swinv2_tiny_window8_256")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrained", action="store_true")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = timm.create_model(args.model, pretrained=args.pretrained).eval().to(device, dtype)
    reference = copy.deepcopy(model)

    timm_flashwin.patch_model(model)  # <- the one line
    print(timm_flashwin.patch_report(model).summary())

    size = model.pretrained_cfg["input_size"][1:]
    images = torch.randn(args.batch, 3, *size, device=device, dtype=dtype)
    with torch.inference_mode():
        logits = model(images)
        expected = reference(images)
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    rel = ((logits.float() - expected.float()).norm() / expected.float().norm()).item()
    print(f"{device} {dtype}: top-1 agreement with unpatched timm {agree:.0%}, relative difference {rel:.1e}")
    assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-4)


if __name__ == "__main__":
    main()
