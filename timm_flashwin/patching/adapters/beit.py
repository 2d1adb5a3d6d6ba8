"""BEiT (beit_*, beitv2_*): ``timm.models.beit.Attention``, global attention over the class
token and the patches (N = 197 at 224 px, 577 at 384, 1025 at 512).

S = scale * Q K^T. The module's own bias, where it has a table (``use_rel_pos_bias``): its
((2Wh-1)(2Ww-1) + 3, H) relative_position_bias_table gathered by its (N, N)
relative_position_index (the class token's three rows: cls to token, token to cls, cls to
cls), as timm's ``_get_rel_pos_bias()`` computes it, handed to the op as a ``TableBias``;
the model's shared bias (``use_shared_rel_pos_bias``: one ``RelativePositionBias`` whose
(H, N, N) output every block passes as ``shared_rel_pos_bias``), as it comes, its gradient
flowing back through timm's own gather; both summed where both exist. The qkv bias is
cat(q_bias, k_bias (a zero buffer), v_bias), as SwinV2's. timm passes the bias to
``scaled_dot_product_attention`` as a float mask (or adds it to its eager scores); the op
computes the same softmax.

The op serves up to ``MAX_TOKENS`` tokens: a module whose table is for more is not patched
(its reason in the report); one without a table sees its token count at call time, and
keeps timm's forward for a call of more (with a warning).
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Type, Union

import torch
from torch import nn

from ...ops.window_checks import MAX_TOKENS
from ...ops.dispatch import exporting
from ...ops.position_bias import TableBias
from .base import WindowAttentionAdapter, inference_cache
from .swinv2 import SwinV2Adapter


class BeitAdapter(WindowAttentionAdapter):
    family = "beit"
    required = ("qkv", "proj", "proj_drop", "attn_drop", "scale", "num_heads", "q_bias", "k_bias", "v_bias",
                "relative_position_bias_table", "relative_position_index", "window_size")
    forward_arg = "shared_rel_pos_bias"

    @staticmethod
    def module_type() -> Type[nn.Module]:
        from timm.models.beit import Attention
        return Attention

    def window_size(self, module: nn.Module) -> None:
        return None  # global attention: the op checks the token count (``tokens``, at patch time where known)

    @staticmethod
    def tokens(module: nn.Module) -> Optional[int]:
        """N of the module's bias (the patches and the class token), None without a table."""
        index = module.relative_position_index
        return index.shape[-1] if module.relative_position_bias_table is not None and index is not None else None

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is None and (self.tokens(module) or 0) > MAX_TOKENS:
            return (f"its relative-position bias is for {self.tokens(module)} tokens "
                    f"({module.window_size[0]}x{module.window_size[1]} patches and the class token), more than "
                    f"{MAX_TOKENS}")
        return reason

    # -- what the op takes ----------------------------------------------------------------
    qkv = SwinV2Adapter.qkv

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor, None]:
        table, index = module.relative_position_bias_table, module.relative_position_index
        if table is None:
            return None
        return inference_cache(module, (table, index), lambda: TableBias(table, index, constant_index=not exporting()))

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Replacement of the module's forward: x (B, N, C), the shared bias (H, N, N) or None
        -> (B, N, C)."""
        in_features = self.in_features(module)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != in_features:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, N, C = {in_features}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        tokens = self.tokens(module)
        if tokens is not None and x.shape[1] != tokens:
            raise ValueError(f"{type(module).__name__}: its relative-position bias is for N = {tokens} tokens "
                             f"(the class token and {module.window_size[0]}x{module.window_size[1]} patches), got "
                             f"x of shape {tuple(x.shape)}")
        if x.shape[1] > MAX_TOKENS:
            warnings.warn(f"timm_flashwin: {type(module).__name__} got {x.shape[1]} tokens, more than the op's "
                          f"{MAX_TOKENS}: timm's forward computes this call", RuntimeWarning, stacklevel=3)
            return module._flashwin_timm_forward(x, shared_rel_pos_bias)
        bias = None
        if shared_rel_pos_bias is not None:
            own = self.position_bias(module)
            if isinstance(own, TableBias):
                own = own.dense()
            bias = shared_rel_pos_bias if own is None else own + shared_rel_pos_bias
        return self._project(module, x, None, bias=bias)
