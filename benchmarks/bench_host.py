"""Host time of one window-attention call: what an eager, launch-bound step pays per layer.

    python benchmarks/bench_host.py --out results/host.json [--profile results/host_profile.txt]

For the first shifted attention module of each family (timm's, unpatched, against a
patched copy), on one image's windows (batch 1) so that the GPU finishes each kernel long
before the host enqueues the next: the wall time per call of the forward (inference mode, bf16 weights) and of the
forward + backward (AMP, float32 weights, bf16 autocast), averaged over many calls with
one synchronization at the end. That is host time: Python, dispatch, autograd and kernel
launches. ``--profile`` writes cProfile's view of the patched forward + backward calls.
GPU only.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import code_version, host_us_per_call, write_json  # noqa: E402
from timm_flashwin import patch_model  # noqa: E402
from timm_flashwin.patching.model import _attention_modules  # noqa: E402
from timm_flashwin.tools.verify import build_model  # noqa: E402

MODELS = ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224"]


def first_shifted_attention(model: torch.nn.Module):
    """(attention module, its block's shift mask or None) of the first shifted block."""
    mods = [(name, mod) for name, mod, adapter, _ in _attention_modules(model) if adapter is not None]
    name, attn = mods[1]  # blocks alternate plain / shifted: the second is shifted
    block = model.get_submodule(name.rsplit(".", 1)[0])
    mask = getattr(block, "attn_mask", None)
    return attn, mask


def calls_of(attn, x, mask, train: bool):
    def infer():
        with torch.inference_mode():
            attn(x, mask=mask) if mask is not None else attn(x)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = attn(x, mask=mask) if mask is not None else attn(x)
        out.float().sum().backward()

    return train_step if train else infer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, help="write cProfile of the patched fwd+bwd calls here")
    args = parser.parse_args()
    rows, profiles = [], []
    for name in args.models:
        model = build_model(name).cuda()
        ours = patch_model(copy.deepcopy(model))
        for train in (False, True):
            row = dict(model=name, mode="train (AMP)" if train else "inference (bf16)")
            for variant, net in (("timm", model), ("flashwin", ours)):
                net = net if train else copy.deepcopy(net).to(torch.bfloat16)
                net.train(train)
                attn, mask = first_shifted_attention(net)
                windows = mask.shape[0] if mask is not None else 1
                tokens = attn.window_size[0] * attn.window_size[1]
                x = torch.randn(windows, tokens, attn.qkv.in_features,
                                device="cuda", dtype=torch.float32 if train else torch.bfloat16,
                                requires_grad=train)
                mask = mask.cuda() if mask is not None else None
                fn = calls_of(attn, x, mask, train)
                row[f"{variant}_us"] = host_us_per_call(fn, args.calls)
                if variant == "flashwin" and train and args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(100):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    for order in ("cumulative", "tottime"):
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
                        profiles.append(f"==== {name}, 100 patched fwd+bwd calls, by {order}\n{text.getvalue()}")
            row["windows"] = windows
            rows.append(row)
            print(f"{name:36s} {row['mode']:18s} timm {row['timm_us']:7.1f} us  patched {row['flashwin_us']:7.1f} us"
                  f"  ({windows} windows)", flush=True)
            if args.out:
                write_json(args.out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                          code=code_version(), rows=rows))
    if args.profile:
        os.makedirs(os.path.dirname(os.path.abspath(args.profile)), exist_ok=True)
        with open(args.profile, "w") as f:
            f.write("\n".join(profiles))


if __name__ == "__main__":
    main()
