"""What the adapters of attention with a decomposed relative-position bias share (SAM's image
encoder: timm's ``vision_transformer_sam.Attention``, transformers' ``SamVisionAttention`` and
SAM-HQ's; ViTDet's ``VitDetAttention``).

Each such module takes x (B, H, W, C), a whole feature map (a global block) or one window of
one (a window block: the block pads the map to a multiple of its window with zero tokens and
partitions it, which the module cannot tell apart), and computes
``softmax(scale * q k^T + bias) v`` with SAM's ``get_decomposed_rel_pos_bias``: here the op
``decomposed_attention`` on views of the qkv projection, its two terms from the module's
own tables (``rel_pos_table_terms``: the tables interpolated as the model's own
``get_rel_pos`` does it, ``ops.rel_pos.gathered_table``'s values, which the tests hold against
each model's function), and the module's proj. What differs between the classes is where they
keep their parts: ``rel_pos_tables``, ``interpolates_always``, ``num_heads``, ``attn_drop``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ...ops.rel_pos import decomposed_attention, rel_pos_table_terms
from .base import WindowAttentionAdapter



class DecomposedRelPosAdapter(WindowAttentionAdapter):
    """Routes a module computing SAM's decomposed relative-position attention through
    ``decomposed_attention``. Its grid is known at call time only (any map or window size:
    the tables are interpolated as the model does)."""

    forward_arg = None
    required = ("qkv", "proj", "rel_pos_h", "rel_pos_w")

    def window_size(self, module: nn.Module) -> Optional[Tuple[int, int]]:
        return None

    def head_dim(self, module: nn.Module) -> int:
        return module.qkv.out_features // (3 * self.num_heads(module))

    def uses_rel_pos(self, module: nn.Module) -> bool:
        return bool(getattr(module, "use_rel_pos", False))

    def rel_pos_tables(self, module: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        return module.rel_pos_h, module.rel_pos_w

    #: whether the model's get_rel_pos interpolates the tables also where they have the rows
    #: the grid needs (transformers' SAM: the same values; ``gathered_table``)
    interpolates_always: bool = False

    def table_size(self, module: nn.Module) -> Tuple[int, int]:
        """The grid the module's tables were made for (their 2 * size - 1 rows)."""
        rel_pos_h, rel_pos_w = self.rel_pos_tables(module)
        return (rel_pos_h.shape[0] + 1) // 2, (rel_pos_w.shape[0] + 1) // 2

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if not self.uses_rel_pos(module) and all(hasattr(module, name) for name in ("qkv", "proj")):
            return ("no relative position (use_rel_pos=False): plain attention, which the model's own SDPA "
                    "call already fuses")
        return super().unsupported(module)

    def describe(self, module: nn.Module, parent: Optional[nn.Module]) -> Optional[str]:
        """"window 14x14" or "global 64x64" (the table's grid): what the block around it does
        (its ``window_size``; 0 for a global block)."""
        if not self.uses_rel_pos(module):  # no tables (transformers' default ViTDet): nothing to describe
            return None
        window = getattr(parent, "window_size", None)
        height, width = self.table_size(module)
        if isinstance(window, int) and window > 0:
            return f"window {window}x{window}"
        return f"global {height}x{width}" if window == 0 else None

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, H, W, C) -> (B, H, W, C)."""
        channels = self.in_features(module)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[3] != channels:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, H, W, C) with C = {channels}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        batch, height, width, _ = x.shape
        return self._project(module, x, None).view(batch, height, width, -1)

    def position_bias(self, module: nn.Module) -> None:
        return None  # the bias is the decomposed one, made from q in ``_attention``

    def q_k_norm(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q and k as the module normalizes them before the attention (timm's qk_norm)."""
        return q, k

    def scale(self, module: nn.Module) -> float:
        return float(module.scale)

    def _attention(self, module: nn.Module, x: torch.Tensor, bias: None, mask: None, dropout_p: float,
                   grid=None) -> torch.Tensor:
        """x (B, H, W, C) -> the proj input (B, H * W, heads * D): the qkv projection, q, k and
        v as strided views of it (no copy), the bias's terms and the op."""
        batch, height, width, channels = x.shape
        heads = self.num_heads(module)
        tokens = height * width
        qkv = self.qkv(module, x.reshape(batch, tokens, channels)).view(batch, tokens, 3, heads, -1)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, heads, N, D) each
        q, k = self.q_k_norm(module, q, k)
        if q.dtype != v.dtype:  # a norm under autocast gives float32: SDPA computes in v's dtype then
            q, k = q.to(v.dtype), k.to(v.dtype)
        rel_pos_h, rel_pos_w = self.rel_pos_tables(module)
        rel_h, rel_w = rel_pos_table_terms(q, rel_pos_h, rel_pos_w, (height, width), self.interpolates_always)
        out = decomposed_attention(q, k, v, rel_h, rel_w, key_size=(height, width), scale=self.scale(module),
                                   dropout_p=dropout_p)
        return out.transpose(1, 2).reshape(batch, tokens, -1)
