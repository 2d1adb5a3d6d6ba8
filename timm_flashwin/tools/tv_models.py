"""torchvision models for ``verify`` and ``bench`` (``timm-flashwin verify --tv swin_t``): a
model of torchvision's registry, called on images (or clips) like a timm model.

NAME is a name of ``torchvision.models.list_models()`` (swin_t, swin_v2_t, swin3d_t, ...),
built by ``torchvision.models.get_model`` with random weights drawn from ``seed`` (or its
default weights where ``pretrained``: torchvision fetches them into torch's hub cache).
Image models take (B, 3, H, W) at their weights' crop size (224, the V2 models 256), video
models (B, 3, T, H, W) clips of ``VIDEO_FRAMES`` frames at their crop size; ``img_size``
(N or (H, W)) sets the images' or frames' size.
"""
from __future__ import annotations

import fnmatch
from typing import Dict, List, Optional

import torch
from torch import nn

#: ``verify_model`` / ``benchmark_model`` names that start with this are torchvision models
TV_PREFIX = "tv:"
#: the frames of a video model's clips (the issue's benchmark: clips of 16 x 224 x 224)
VIDEO_FRAMES = 16


class TvModel(nn.Module):
    """A torchvision model with ``pretrained_cfg["input_size"]`` as timm models carry it: (3, H,
    W), or (3, T, H, W) for a video model."""

    def __init__(self, model: nn.Module, input_size):
        super().__init__()
        self.model = model
        self.pretrained_cfg = {"input_size": tuple(input_size)}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)


def is_video(name: str) -> bool:
    import torchvision
    return name in torchvision.models.list_models(module=torchvision.models.video)


def input_size(name: str, img_size=None):
    """(3, H, W) or (3, T, H, W) of ``name``'s inputs (the module's docstring)."""
    import torchvision
    if img_size is None:
        try:
            crop = torchvision.models.get_model_weights(name).DEFAULT.transforms().crop_size
        except (ValueError, AttributeError, KeyError):
            crop = [224]
        img_size = tuple(crop) if len(crop) == 2 else (crop[0], crop[0])
    elif isinstance(img_size, int):
        img_size = (img_size, img_size)
    return (3, VIDEO_FRAMES, *img_size) if is_video(name) else (3, *img_size)


def build_tv_model(name: str, *, img_size=None, pretrained: bool = False, train: bool = False, seed: int = 0,
                   overrides: Optional[Dict] = None) -> TvModel:
    """torchvision's ``name`` (``overrides``: more keyword arguments of its builder), without
    stochastic depth where ``train`` (the compared runs must draw alike)."""
    import torchvision
    from torchvision.ops import StochasticDepth
    from .usage import UsageError

    if name not in torchvision.models.list_models():
        import difflib
        close = difflib.get_close_matches(name, torchvision.models.list_models(), n=4, cutoff=0.5)
        raise UsageError(f"--tv {name}: not a torchvision model" + (f"; did you mean {', '.join(close)}?" if close
                                                                     else ""))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = torchvision.models.get_model(name, weights="DEFAULT" if pretrained else None, **(overrides or {}))
        except TypeError as exc:
            raise UsageError(f"--tv {name}: cannot build with {overrides}: {exc}") from None
        except (OSError, RuntimeError) as exc:
            if pretrained:
                raise UsageError(f"--tv {name} --pretrained: its weights could not be fetched (offline?): "
                                 f"{str(exc).splitlines()[0][:200]}") from None
            raise
    if train:
        for module in model.modules():
            if isinstance(module, StochasticDepth):
                module.p = 0.0
    return TvModel(model, input_size(name, img_size))


def served_tv_models(pattern: str = "*") -> List[str]:
    """torchvision's model names matching ``pattern`` whose builder's module defines a class
    an adapter serves (the candidates ``discovery.supported_tv_models`` builds)."""
    import sys
    import torchvision
    from ..patching.adapters import ADAPTERS
    classes = {cls for adapter in ADAPTERS.values() if (cls := adapter.module_type()) is not None}
    names = []
    for name in torchvision.models.list_models():
        module = sys.modules.get(torchvision.models.get_model_builder(name).__module__)
        if fnmatch.fnmatch(name, pattern) and any(isinstance(obj, type) and obj in classes
                                                  for obj in vars(module).values()):
            names.append(name)
    return names
