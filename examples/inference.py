"""Patch a timm model with one call and check that it predicts what timm's model does.

    python examples/inference.py [--model swinv2_tiny_window8_256] [--batch 8] [--pretrained]
    python examples/inference.py --batch 2                                    # a CPU, under a minute
    TRITON_INTERPRET=1 python examples/inference.py --batch 1 --img-size 64   # the kernels on a CPU

On a GPU the model runs in bfloat16 through the Triton kernels. On a CPU it runs in float32
through PyTorch's math (no speedup there, and timm's own math: no difference to find), or
with TRITON_INTERPRET=1 through the kernels under Triton's interpreter: slow, hence the
small setting above (under a minute on 2 cores).

Without --pretrained the weights are timm's random init, perturbed as ``timm-flashwin
verify`` perturbs them (``timm_flashwin.tools.verify.perturb_``): a fresh SwinV2 zero-initialises
its post-norm weights, so its attention would not reach the output and any kernel would
"match". The printed difference is then a real comparison of the attention.
"""
import argparse
import copy
import sys
from typing import List, Optional

import timm
import torch

import timm_flashwin
from timm_flashwin.tools.verify import backend_name, perturb_


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="swinv2_tiny_window8_256", help="timm model name")
    parser.add_argument("--batch", type=int, default=8, help="images")
    parser.add_argument("--img-size", type=int, default=None, help="image side in pixels; None: the model's own")
    parser.add_argument("--pretrained", action="store_true",
                        help="timm's pretrained weights (downloaded unless cached) instead of perturbed random ones")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"building {args.model} ({'pretrained' if args.pretrained else 'random init, perturbed'}) on {device}",
          flush=True)
    torch.manual_seed(0)
    size_kwargs = {} if args.img_size is None else {"img_size": args.img_size}
    model = timm.create_model(args.model, pretrained=args.pretrained, **size_kwargs)
    if not args.pretrained:
        perturb_(model)  # so that attention reaches the output (the module docstring)
    model = model.eval().to(device, dtype)
    reference = copy.deepcopy(model)
    backend = backend_name(torch.device(device), dtype)  # what computes the patched attention

    timm_flashwin.patch_model(model)  # <- the one line
    print(timm_flashwin.patch_report(model).summary(), flush=True)

    size = (args.img_size, args.img_size) if args.img_size else model.pretrained_cfg["input_size"][1:]
    images = torch.randn(args.batch, 3, *size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    with torch.inference_mode():
        print("running timm's model", flush=True)
        expected = reference(images)
        print(f"running the patched model (attention: {backend})", flush=True)
        logits = model(images)
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    rel = ((logits.float() - expected.float()).norm() / expected.float().norm()).item()
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"{device} {dtype}: top-1 agreement with unpatched timm {agree:.0%}, relative difference {rel:.1e} "
          f"(tolerance {tolerance:.0e})")
    if backend == "pytorch":
        print("(the patched modules computed timm's math in PyTorch here, so no difference is expected; "
              "TRITON_INTERPRET=1 runs the kernels on a CPU)")
    if not rel <= tolerance:
        sys.exit(f"the patched model's output differs from timm's by {rel:.1e} (> {tolerance:.0e})")


if __name__ == "__main__":
    main()
