"""GCViT: ``timm.models.gcvit.WindowAttentionGlobal``.

S = scale * Q K^T (scale = head_dim^-0.5) plus the bias of the module's ``rel_pos``, timm's
``RelPosBias`` (Swin V1's table ((2Wh-1)(2Ww-1), H) gathered by relative_position_index:
``rel_pos.rel_pos_bias``); no mask. The block hands the module its windows (B * nW, N, C)
and its stage's global query q_global (B, Wh, Ww, C), one per image:

- local blocks (``use_global`` False, even blocks): qkv is the module's (B_, N, 3 C) linear
  output, plain window attention; q_global is ignored, as timm ignores it;
- global blocks (odd ones): the module's linear gives k and v only, (B_, N, 2 C), and every
  window of an image takes that image's q_global as its queries. The op takes the two
  (``window_attention(kv, ..., query=)``): its kernels read each window's queries from
  q_global itself, with no broadcast copy, and sum q's gradient over an image's windows.

Which image a window's query comes from is timm's: 1.0.31 repeats q_global with
``repeat_interleave`` (window b takes image b // nW, the order of the block's partition),
1.0.29 with ``repeat`` (image b % B: other images' queries where B > 1). The patched module
computes what the installed timm's forward computes (``query_order``).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Callable, Dict, Optional, Type, Union

import torch
from torch import nn

from ...ops.window import window_attention
from ...ops.position_bias import TableBias
from .base import WindowAttentionAdapter
from .rel_pos import rel_pos_bias, unsupported_rel_pos

#: ``query_order``'s answers: window b takes image b // nW's query, or image b % B's
IMAGE_MAJOR, TILED = "image_major", "tiled"


@functools.lru_cache(maxsize=None)
def _order_of(forward: Callable) -> Optional[str]:
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):  # no source installed: the order cannot be known
        return None
    interleaved, tiled = (re.search(rf"q_global\.{name}\(", source) is not None
                          for name in ("repeat_interleave", "repeat"))
    return IMAGE_MAJOR if interleaved and not tiled else TILED if tiled and not interleaved else None


# a constant under torch.compile (dynamo cannot trace inspect.getsource): the order is the
# installed timm's, read where the graph is made
@torch.compiler.assume_constant_result
def query_order() -> Optional[str]:
    """How the installed timm's ``WindowAttentionGlobal.forward`` gives each window its global
    query: ``IMAGE_MAJOR`` (``repeat_interleave``), ``TILED`` (``repeat``), or None where its
    source says neither (read once per forward function: a monkeypatched one is read anew)."""
    from timm.models.gcvit import WindowAttentionGlobal
    return _order_of(WindowAttentionGlobal.forward)


class GcVitAdapter(WindowAttentionAdapter):
    family = "gcvit"
    forward_arg = "q_global"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "scale", "num_heads", "head_dim", "window_size",
                "use_global", "rel_pos")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.gcvit import WindowAttentionGlobal
        return WindowAttentionGlobal

    def head_dim(self, module: nn.Module) -> int:
        return module.head_dim

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is not None:
            return reason
        channels = module.num_heads * module.head_dim
        projections = 2 if module.use_global else 3
        if (module.qkv.in_features, module.qkv.out_features) != (channels, projections * channels):
            return (f"qkv maps {module.qkv.in_features} to {module.qkv.out_features} channels, not {channels} to "
                    f"{projections} x {channels} (num_heads {module.num_heads} x head_dim {module.head_dim})")
        if module.use_global and query_order() is None:
            import timm
            return (f"timm {timm.__version__}: WindowAttentionGlobal's forward repeats q_global neither with "
                    "repeat_interleave nor with repeat: which image's query each window takes is not known")
        return unsupported_rel_pos(module.rel_pos)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        return rel_pos_bias(module, module.rel_pos)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, q_global: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward, timm's signature: x (B_, N, C) and q_global
        (B, Wh, Ww, C) with B_ a multiple of B (read in global blocks only) -> (B_, N, C)."""
        if not module.use_global:
            return super().forward(module, x, None)
        if q_global is None:  # timm reads the 2 C channels of its kv linear as q, k, v: its error
            return module._flashwin_timm_forward(x, q_global)
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            windows, n, channels = x.shape
            if (not isinstance(q_global, torch.Tensor) or q_global.dim() < 2 or q_global.shape[-1] != channels
                    or windows % max(q_global.shape[0], 1) or q_global[0].numel() != n * channels):
                raise ValueError(
                    f"{type(module).__name__}: expected q_global of shape (B, Wh, Ww, C) with Wh*Ww = {n} tokens, "
                    f"C = {channels} and B dividing the {windows} windows, got "
                    f"{tuple(q_global.shape) if isinstance(q_global, torch.Tensor) else type(q_global).__name__}")
        # the per-call tensor that ``_project`` passes on to ``_attention`` (and through the
        # checkpoint of recompute_qkv): a mask in other families, q_global here (GCViT has no mask)
        return super().forward(module, x, q_global)

    def _attention(self, module: nn.Module, x: torch.Tensor, bias: Union[TableBias, torch.Tensor],
                   q_global: Optional[torch.Tensor], dropout_p: float, grid=None) -> torch.Tensor:
        """x (B_, N, C) -> the proj input (B_, N, C): the op on the module's qkv linear, or,
        with q_global (B, Wh, Ww, C), on its kv linear with the query shared by each image's
        windows (``query_order``). ``grid`` is never given: GCViT's blocks are not patched."""
        qkv = module.qkv(x)
        if q_global is None:
            return window_attention(qkv, module.num_heads, bias=bias, dropout_p=dropout_p,
                                    **self.score_scale(module))
        # timm's q @ k^T under autocast multiplies in kv's dtype: q rounded to it as there
        query = q_global.reshape(q_global.shape[0], -1, x.shape[-1]).to(qkv.dtype)
        return window_attention(qkv, module.num_heads, bias=bias, dropout_p=dropout_p, query=query,
                                query_order=query_order(), **self.score_scale(module))

