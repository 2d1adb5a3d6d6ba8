"""timm_flashwin: fused Triton window attention for timm's Swin family."""
from .op import window_attention
from .reference import window_attention_reference

__version__ = "0.1.0"

__all__ = ["window_attention", "window_attention_reference", "__version__"]
