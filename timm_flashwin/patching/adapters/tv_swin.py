"""torchvision's Swin V1 and V2: ``torchvision.models.swin_transformer.ShiftedWindowAttention``
(swin_t / s / b) and ``ShiftedWindowAttentionV2`` (swin_v2_t / s / b).

The module's forward is the whole window attention of a block on its (B, H, W, C) map
(torchvision's ``shifted_window_attention``), and this adapter computes what it computes:

- pad the map at the bottom and the right to whole windows (before the shift: the padded
  tokens, zeros, take part in the attention as timm's do not), then drop the shift along a
  dimension where the window covers the padded map;
- where the shift is not zero, roll by -shift, the shift mask over the padded map (0 / -100,
  built as torchvision builds it in each forward: here once per padded size, window, shift
  and device, kept on the module, so that the op sees the same mask tensor at every call
  and keeps its region structure, ``bias_mask.kept_mask_structure``);
- the qkv linear (F.linear of the module's weights, as torchvision's: hooks on ``qkv`` and
  ``proj`` do not run there either), V1's ``scale * Q K^T`` with scale (C / heads)^-1/2 or
  V2's cosine scores with the logit scale clamped at ln 100; V1's table gathered by the
  index (``TableBias``), V2's 16 sigmoid(cpb_mlp(relative_coords_table)) gathered
  (``swinv2.cpb_position_bias``), V2's qkv bias with its k third zeroed (a clone: its
  gradient there is 0); attention dropout in the kernels; proj and its dropout; merge, roll
  back, crop.

In eager mode the op reads the windows from the (padded) map where they lie
(``WindowGrid``: the roll, partition, merge and roll-back copies are not made); under
torch.compile the roll and partition are PyTorch's, which inductor fuses.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.dispatch import exporting, no_dispatch_mode
from ...ops.position_bias import TableBias
from ...ops.window_grid import WindowGrid
from .base import WindowAttentionAdapter, inference_cache
from .rel_pos import KEPT_ATTR, _square_index
from .swinv2 import cpb_position_bias


def kept_for_shape(module: nn.Module, name: str, key: tuple, compute: Callable):
    """``compute()`` for a value that depends only on ``key`` (sizes, device): kept on the
    module under ``name`` while the key is the same (eager mode, made outside inference mode
    so that it serves training calls too); computed at every call under dispatch modes."""
    if not no_dispatch_mode():
        return compute()
    kept = module.__dict__.setdefault(KEPT_ATTR, {})
    entry = kept.get(name)
    if entry is None or entry[0] != key:
        with torch.inference_mode(False):
            entry = kept[name] = (key, compute())
    return entry[1]


def shift_mask_2d(height: int, width: int, window: Tuple[int, int], shift: Tuple[int, int],
                  device: torch.device) -> torch.Tensor:
    """torchvision's shift mask of a padded (height, width) map, (nW, N, N) float32 0 / -100:
    its 3 x 3 slices numbered as ``shifted_window_attention`` numbers them (with a zero
    shift along a dimension, its later slices cover that dimension whole)."""
    mask = torch.zeros((height, width), device=device)
    h_slices = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
    w_slices = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
    count = 0
    for h in h_slices:
        for w in w_slices:
            mask[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    windows = (height // window[0]) * (width // window[1])
    mask = mask.view(height // window[0], window[0], width // window[1], window[1])
    mask = mask.permute(0, 2, 1, 3).reshape(windows, window[0] * window[1])
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


@torch.compiler.assume_constant_result
def _constant_mask_2d(height: int, width: int, wh: int, ww: int, sh: int, sw: int,
                      device: torch.device) -> Tuple[torch.Tensor]:
    """``(shift_mask_2d(...),)`` as a constant of a graph torch.compile traces (dynamo calls it
    with the ints), so that a compiled step does not build it. A tuple: dynamo names a tuple
    constant apart in each call, a lone tensor by the function, which a second call in one
    graph then shares (torch 2.14: AOTAutograd stops, "already in seen_sources";
    ``rel_pos._traced_one_hot_rows``)."""
    return (shift_mask_2d(height, width, (wh, ww), (sh, sw), device),)


def module_shift_mask(module: nn.Module, build: Callable, constant: Callable, size: Tuple[int, ...],
                      window: Tuple[int, ...], shift: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The shift mask ``build(*size, window, shift, device)`` for this call: kept on the module
    in eager mode, a constant of the graph under torch.compile (``constant(*size, *window,
    *shift, device)[0]``), computed in the graph under torch.export."""
    if torch.compiler.is_compiling():
        return build(*size, window, shift, device) if exporting() else constant(*size, *window, *shift, device)[0]
    return kept_for_shape(module, "shift_mask", (size, window, shift, device),
                          lambda: build(*size, window, shift, device))


class TvSwinAdapter(WindowAttentionAdapter):
    """``ShiftedWindowAttention``: V1 scores and table bias."""

    family = "tv_swin"
    required = ("qkv", "proj", "relative_position_bias_table", "relative_position_index", "window_size",
                "shift_size", "num_heads", "attention_dropout", "dropout")
    forward_arg = None

    @staticmethod
    def module_type() -> Optional[Type[nn.Module]]:
        try:
            from torchvision.models.swin_transformer import ShiftedWindowAttention
        except ImportError:  # pragma: no cover - timm requires torchvision
            return None
        return ShiftedWindowAttention

    # -- geometry ---------------------------------------------------------------------
    def head_dim(self, module: nn.Module) -> int:
        return module.qkv.in_features // module.num_heads

    def attn_drop(self, module: nn.Module) -> float:
        return float(module.attention_dropout)

    def unsupported(self, module: nn.Module) -> Optional[str]:
        reason = super().unsupported(module)
        if reason is not None:
            return reason
        dim, heads = module.qkv.in_features, module.num_heads
        if dim % heads or module.qkv.out_features != 3 * dim or module.proj.in_features != dim:
            return f"qkv {tuple(module.qkv.weight.shape)} and proj {tuple(module.proj.weight.shape)} are not " \
                   f"torchvision's for dim {dim} and {heads} heads"
        window, shift = tuple(module.window_size), tuple(module.shift_size)
        if len(shift) != len(window) or not all(0 <= s < w for s, w in zip(shift, window)):
            return f"shift_size {list(shift)} is not within [0, window) of window_size {list(window)}"
        if not 0.0 <= float(module.dropout) <= 1.0:
            return f"dropout={module.dropout} is not in [0, 1]"
        return None

    # -- what the op takes ----------------------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, module.qkv.weight, module.qkv.bias)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        table, index = module.relative_position_bias_table, module.relative_position_index
        return inference_cache(module, (table, index), lambda: TableBias(
            table, _square_index(module, index), constant_index=not exporting()))

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(self.head_dim(module) ** -0.5))

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.linear(y, module.proj.weight, module.proj.bias), p=module.dropout, training=module.training)

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, unused=None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, H, W, C) -> (B, H, W, C)."""
        in_features = self.in_features(module)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] != in_features:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, H, W, C = {in_features}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        batch, height, width, channels = x.shape
        wh, ww = module.window_size
        pad_b, pad_r = (wh - height % wh) % wh, (ww - width % ww) % ww
        if pad_b or pad_r:
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        ph, pw = height + pad_b, width + pad_r
        # no shift along a dimension the window covers (torchvision's rule, on the padded map)
        shift = (0 if wh >= ph else module.shift_size[0], 0 if ww >= pw else module.shift_size[1])
        shifted = sum(shift) > 0
        mask = (module_shift_mask(module, shift_mask_2d, _constant_mask_2d, (ph, pw), (wh, ww), shift, x.device)
                if shifted else None)
        if not torch.compiler.is_compiling():
            # the windows read from the map where they lie (the op partitions it itself where
            # its kernels cannot)
            grid = kept_for_shape(module, "grid", (ph, pw, wh, ww, shift),
                                  lambda: WindowGrid(ph, pw, (wh, ww), shift))
            out = self._project(module, x.reshape(batch, ph * pw, channels), mask, grid).view(batch, ph, pw, -1)
        else:
            if shifted:
                x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
            windows = x.view(batch, ph // wh, wh, pw // ww, ww, channels).permute(0, 1, 3, 2, 4, 5)
            out = self._project(module, windows.reshape(-1, wh * ww, channels), mask)
            out = out.view(batch, ph // wh, pw // ww, wh, ww, -1).permute(0, 1, 3, 2, 4, 5).reshape(batch, ph, pw, -1)
            if shifted:
                out = torch.roll(out, shifts=shift, dims=(1, 2))
        return out[:, :height, :width].contiguous() if pad_b or pad_r else out


class TvSwinV2Adapter(TvSwinAdapter):
    """``ShiftedWindowAttentionV2``: cosine scores, the cpb_mlp's bias, k bias zeroed."""

    family = "tv_swinv2"
    required = TvSwinAdapter.required[:1] + ("proj", "logit_scale", "cpb_mlp", "relative_coords_table",
                                              "relative_position_index", "window_size", "shift_size", "num_heads",
                                              "attention_dropout", "dropout")

    @staticmethod
    def module_type() -> Optional[Type[nn.Module]]:
        try:
            from torchvision.models.swin_transformer import ShiftedWindowAttentionV2
        except ImportError:  # pragma: no cover - timm requires torchvision
            return None
        return ShiftedWindowAttentionV2

    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        bias = module.qkv.bias
        if bias is not None:  # torchvision's: the k third zeroed in a clone
            bias = bias.clone()
            length = bias.numel() // 3
            bias[length:2 * length].zero_()
        return F.linear(x, module.qkv.weight, bias)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor]:
        return cpb_position_bias(module, module.cpb_mlp, module.relative_coords_table,
                                 _square_index(module, module.relative_position_index), module.num_heads)

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(logit_scale=module.logit_scale)


__all__ = ["TvSwinAdapter", "TvSwinV2Adapter", "kept_for_shape", "module_shift_mask", "shift_mask_2d"]
