"""One adapter per attention family: timm's, torchvision's (``tv_*``) and transformers' (``hf_*``)."""
from typing import Dict, Optional

from torch import nn

from .base import WindowAttentionAdapter
from .beit import BeitAdapter
from .davit import DaVitAdapter
from .gcvit import GcVitAdapter
from .hf_beit import HfBeitAdapter, HfData2VecVisionAdapter
from .hf_sam import (HfSamHqVisionAdapter, HfSamHqVisionSdpaAdapter, HfSamVisionAdapter, HfSamVisionSdpaAdapter,
                     HfVitDetAdapter)
from .hf_swin import HfDonutSwinAdapter, HfMaskFormerSwinAdapter, HfSwinAdapter
from .hf_swinv2 import HfSwin2SRAdapter, HfSwinv2Adapter
from .hiera import HieraAdapter
from .maxxvit import MaxxVit2dAdapter, MaxxVitAdapter
from .nest import NestAdapter
from .samvit import SamVitAdapter
from .swin import SwinAdapter
from .swinv2 import SwinV2Adapter
from .swinv2_cr import SwinV2CRAdapter
from .tiny_vit import TinyVitAdapter
from .tv_swin import TvSwinAdapter, TvSwinV2Adapter
from .tv_swin3d import TvSwin3dAdapter
from .twins import TwinsAdapter

#: family name -> adapter (timm's families, then torchvision's: their modules' classes are
#: importable wherever timm is, which imports torchvision's models)
ADAPTERS: Dict[str, WindowAttentionAdapter] = {a.family: a for a in (
    SwinAdapter(), SwinV2Adapter(), SwinV2CRAdapter(), MaxxVitAdapter(), MaxxVit2dAdapter(), TinyVitAdapter(),
    DaVitAdapter(), TwinsAdapter(), NestAdapter(), HieraAdapter(), GcVitAdapter(), BeitAdapter(), SamVitAdapter(),
    TvSwinAdapter(), TvSwinV2Adapter(), TvSwin3dAdapter())}

#: family name -> adapter of a Hugging Face transformers class (``patching.hf``); its
#: ``module_type()`` is None until transformers' modeling module is imported
HF_ADAPTERS: Dict[str, WindowAttentionAdapter] = {a.family: a for a in (
    HfSwinAdapter(), HfSwinv2Adapter(), HfDonutSwinAdapter(), HfMaskFormerSwinAdapter(), HfSwin2SRAdapter(),
    HfBeitAdapter(), HfData2VecVisionAdapter(), HfSamVisionAdapter(), HfSamVisionSdpaAdapter(), HfSamHqVisionAdapter(),
    HfSamHqVisionSdpaAdapter(), HfVitDetAdapter())}


def adapter_for(module: nn.Module) -> Optional[WindowAttentionAdapter]:
    """The adapter serving this module's exact class, or None."""
    for adapter in (*ADAPTERS.values(), *HF_ADAPTERS.values()):
        if type(module) is adapter.module_type():
            return adapter
    return None


__all__ = ["ADAPTERS", "HF_ADAPTERS", "WindowAttentionAdapter", "adapter_for"]
