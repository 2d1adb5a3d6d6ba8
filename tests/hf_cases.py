"""Tiny models of transformers' Swin family for the tests (tests/test_hf_swin.py, and the
same checks on a 4.x transformers in a subprocess, its test_transformers4): an 8x8 map
in 4x4 windows (N = 16, four windows, the second block shifted), two heads of 8 channels,
every parameter perturbed (``verify.perturb_``: the bias tables start at zero, SwinV2's
logit scales all at ln 10), no dropout or drop path, so that attention reaches the output
and a training step's gradients can be compared."""
from typing import Callable, Dict, Tuple

import torch
import transformers
from timm_flashwin.tools.hf_models import HfImageModel
from timm_flashwin.tools.verify import perturb_

#: the geometry every family shares (Swin2SR embeds single pixels: its image is the map)
GEOMETRY = dict(embed_dim=16, depths=[2], num_heads=[2], window_size=4, mlp_ratio=2.0, drop_path_rate=0.0,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

#: family -> (config class, model class, its image size, config overrides)
FAMILIES: Dict[str, Tuple[str, str, int, dict]] = {
    "hf_swin": ("SwinConfig", "SwinForImageClassification", 16, dict(patch_size=2, num_labels=5)),
    "hf_swinv2": ("Swinv2Config", "Swinv2ForImageClassification", 16, dict(patch_size=2, num_labels=5)),
    "hf_donut_swin": ("DonutSwinConfig", "DonutSwinModel", 16, dict(patch_size=2)),
    "hf_maskformer_swin": ("MaskFormerSwinConfig", "MaskFormerSwinModel", 16, dict(patch_size=2)),
    "hf_swin2sr": ("Swin2SRConfig", "Swin2SRForImageSuperResolution", 8,
                   dict(patch_size=1, upscale=2, upsampler="pixelshuffle", num_channels=3, num_channels_out=3)),
}


def config(family: str, **overrides) -> transformers.PretrainedConfig:
    config_class, _, size, extra = FAMILIES[family]
    return getattr(transformers, config_class)(image_size=size, **GEOMETRY, **{**extra, **overrides})


def tiny_model(family: str, attn_implementation: str = "", seed: int = 0) -> HfImageModel:
    """``family``'s tiny model, perturbed, in train mode, float32, called as timm models are
    (``HfImageModel``: images -> its first output, flattened); ``attn_implementation``
    where the family's 5.x model takes one ("eager", "sdpa")."""
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config(family))
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    with torch.no_grad():
        perturb_(model, seed)
    return HfImageModel(model).train()


def image_size(family: str) -> int:
    return FAMILIES[family][2]


def counting_op_calls(monkeypatch) -> Callable[[], int]:
    """Counts the adapters' calls of ``window_attention`` from now on: () -> the count."""
    from timm_flashwin.patching.adapters import base
    calls = []
    op = base.window_attention
    monkeypatch.setattr(base, "window_attention", lambda *args, **kwargs: (calls.append(1), op(*args, **kwargs))[1])
    return lambda: len(calls)
