"""timm_flashwin: fused Triton window attention for timm's Swin, SwinV2 and SwinV2-CR.

    import timm, timm_flashwin
    model = timm.create_model("swinv2_tiny_window8_256").cuda()
    timm_flashwin.patch_model(model)           # in place, one line
    with timm_flashwin.patched(other_model):   # temporary
        ...
    timm_flashwin.patch_timm()                 # every model timm.create_model returns, patched
"""
from .factory import CreatedModel, patch_timm, patched_timm, unpatch_timm
from .local_attention import block_sliding_window_attention, sliding_window_attention
from .op import window_attention
from .position_bias import TableBias
from .patching import (ModuleStatus, PatchError, PatchReport, is_patched, patch_model, patch_report, patched,
                       unpatch_model)
from .reference import window_attention_reference
from .window_grid import WindowGrid

__version__ = "0.1.0"

__all__ = [
    "CreatedModel",
    "ModuleStatus",
    "PatchError",
    "PatchReport",
    "TableBias",
    "WindowGrid",
    "block_sliding_window_attention",
    "is_patched",
    "patch_model",
    "patch_report",
    "patch_timm",
    "patched",
    "patched_timm",
    "sliding_window_attention",
    "unpatch_model",
    "unpatch_timm",
    "window_attention",
    "window_attention_reference",
    "__version__",
]
