"""Write tests/model_shapes.json: the (N, head_dim, cosine) of every window-attention call of
every served timm and torchvision model at its default input size (torchvision's video
models on 16-frame clips), with up to three models each, found by running each patched
model once on the meta device (no memory, no weights) and recording what the op validates.
tests/plan_fits.py checks the plans chosen for these shapes. (The file also keeps the shapes of
timm's own test_* models, which the listing now leaves out: 25 and 100 tokens.)

    python tests/model_shapes.py [tests/model_shapes.json]     # about 2 minutes on 2 cores
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import timm
import torch

import timm_flashwin
from timm_flashwin.ops import window as op
from timm_flashwin.tools.discovery import supported_models, supported_tv_models
from timm_flashwin.tools.tv_models import build_tv_model


def main(path: Path) -> None:
    seen: dict = {}
    model_name = [""]
    validate = op.validate

    def recording(qkv, num_heads, bias, mask, scale, logit_scale, *args, **kwargs):
        found = validate(qkv, num_heads, bias, mask, scale, logit_scale, *args, **kwargs)
        seen.setdefault((found[1], found[2], logit_scale is not None), set()).add(model_name[0])
        return found
    op.validate = recording
    try:
        models = [(info.name, timm.create_model) for info in supported_models()]
        models += [(info.name, build_tv_model) for info in supported_tv_models()]
        for name, build in models:
            model_name[0] = name if build is timm.create_model else f"tv:{name}"
            with torch.device("meta"):
                model = timm_flashwin.patch_model(build(name))
                size = model.pretrained_cfg.get("input_size", (3, 224, 224))
                with torch.no_grad():
                    model(torch.empty(1, *size))
    finally:
        op.validate = validate
    rows = sorted([n, d, c, sorted(models)[:3]] for (n, d, c), models in seen.items())
    path.write_text(json.dumps(rows, indent=0) + "\n")
    print(f"{len(rows)} shapes written to {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("model_shapes.json"))
