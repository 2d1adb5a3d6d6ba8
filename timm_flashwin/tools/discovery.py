"""Which timm models the patcher serves, found from the modules they really build."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..patching.adapters import ADAPTERS
from ..patching.factory import timm_create_model
from ..patching.model import _attention_modules


@dataclass
class ModelInfo:
    name: str
    families: List[str]  # model families of its attention modules (``model_family``)
    stage_windows: List[Optional[Tuple[int, ...]]]  # window size of each stage, in order (None: any; a
    # model without stage containers: each of its windows once)
    modules: int  # window-attention modules patched by patch_model


def _stage(name: str) -> Optional[str]:
    """'layers.2.blocks.1.attn' -> 'layers.2' (timm's stage containers: NesT's levels, Twins'
    blocks.i.j); None where the model has none (Hiera's blocks.i)."""
    match = re.match(r"^(.*?(?:layers|stages|levels)[._]\d+|blocks[._]\d+(?=[._]\d))", name)
    return match.group(1) if match else None


def describe(name: str, build: Optional[Callable[[str], torch.nn.Module]] = None) -> ModelInfo:
    """Build ``name`` on the meta device (no memory, no weights; ``build``, timm's factory
    unless given) and describe it."""
    with torch.device("meta"):
        model = (build or timm_create_model())(name)
    families: List[str] = []
    stages: dict = {}
    count = 0
    for mod_name, module, adapter, family in _attention_modules(model):
        if adapter is None or adapter.unsupported(module) is not None:
            continue
        count += 1
        family = adapter.model_family or family
        if family not in families:
            families.append(family)
        window = adapter.window_size(module)
        window = tuple(window) if window is not None else None
        # without stage containers: each window once, in order
        stages.setdefault(_stage(mod_name) or ("window", window), window)
    return ModelInfo(name, families, list(stages.values()), count)


def _candidate_modules() -> List[str]:
    """timm model modules whose namespace holds one of the served attention classes:
    only their models are built (building all of timm's ~1300 takes minutes)."""
    from timm import models  # importing it imports timm.models.*, scanned below
    classes = {adapter.module_type() for adapter in ADAPTERS.values()}
    return sorted(name.rsplit(".", 1)[-1] for name, mod in list(sys.modules.items())
                  if name.startswith(models.__name__ + ".") and mod is not None
                  and any(obj in classes for obj in vars(mod).values() if isinstance(obj, type)))


#: timm's own test models (test_coatnet, test_maxvit...: tiny configurations for timm's test
#: suite, not models to use) are not listed
EXCLUDED_NAMES = ["test_*"]


def supported_models(pattern: str = "*", progress: Optional[Callable[[int, int], None]] = None) -> List[ModelInfo]:
    """Every timm model name matching ``pattern`` (as timm.list_models) that builds at
    least one window-attention module the patcher serves, timm's test models left out.
    Each candidate is built (on the meta device: about 0.1 s each, 20 s for all of them);
    ``progress(done, total)`` is called before each."""
    import timm
    names = sorted({n for module in _candidate_modules()
                    for n in timm.list_models(pattern, module=module, exclude_filters=EXCLUDED_NAMES)})
    found = []
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names))
        try:
            info = describe(name)
        except Exception:  # a model that cannot build on meta has nothing to offer here
            continue
        if info.modules:
            found.append(info)
    return found


def supported_tv_models(pattern: str = "*", progress: Optional[Callable[[int, int], None]] = None) -> List[ModelInfo]:
    """``supported_models`` of torchvision's registry (``tv_models.served_tv_models``' candidates,
    built on the meta device by ``torchvision.models.get_model``)."""
    import torchvision
    from .tv_models import served_tv_models
    names = served_tv_models(pattern)
    found = []
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names))
        info = describe(name, lambda n: torchvision.models.get_model(n, weights=None))
        if info.modules:
            found.append(info)
    return found
