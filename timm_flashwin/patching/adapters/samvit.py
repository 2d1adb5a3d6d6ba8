"""SAM's image encoder in timm: ``timm.models.vision_transformer_sam.Attention`` (every
``samvit_*`` model) with ``use_rel_pos``: decomposed relative position, global blocks over
the whole map and window blocks over timm's padded 14 x 14 windows (``decomposed``).

timm's forward: qkv (B, N, 3, heads, D), q and k through ``q_norm`` / ``k_norm`` (Identity
without qk_norm), ``get_decomposed_rel_pos_bias`` from the normalized q with the module-level
``get_rel_pos`` (interpolating the tables where the map is another size than they were made
for; ``gathered_table`` here), then SDPA with that bias as a dense mask, or the same math in PyTorch, with dropout
``attn_drop.p`` in training; proj, proj_drop. Without ``use_rel_pos`` (with rotary
embeddings, or none) timm's forward stays: its SDPA call has no bias to fuse.
"""
from __future__ import annotations

from typing import Tuple, Type

import torch
from torch import nn

from .decomposed import DecomposedRelPosAdapter


class SamVitAdapter(DecomposedRelPosAdapter):
    family = "samvit"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "num_heads", "scale", "rel_pos_h", "rel_pos_w",
                "q_norm", "k_norm")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.vision_transformer_sam import Attention
        return Attention

    def q_k_norm(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return module.q_norm(q), module.k_norm(k)
