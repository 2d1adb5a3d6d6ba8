"""torchvision's Video Swin: ``torchvision.models.video.swin_transformer.ShiftedWindowAttention3d``
(swin3d_t / s / b: windows of 8 x 7 x 7 = 392 tokens, shift (4, 3, 3), a 3-D table of
(2Wd-1)(2Wh-1)(2Ww-1) = 2535 rows).

The module's forward on a (B, T, H, W, C) clip is torchvision's ``shifted_window_attention_3d``,
and this adapter computes what it computes: a window dimension longer than the input shrinks
to the input and takes no shift (``_get_window_and_shift_size``: also where they are equal),
the bias is the table gathered by the first ``Wd*Wh*Ww`` rows and columns of the full
window's index (torchvision slices it so; the slice is kept on the module, so that the op
sorts its pairs once), the clip is padded at the end of each dimension to whole windows,
rolled by -shift, partitioned; the shift mask (27 regions where every dimension shifts) is
torchvision's own ``_compute_attention_mask_3d``, built once per padded size, window, shift
and device (kept on the module; under torch.compile a constant of the graph), which the op
reads through its region ids (``bias_mask.mask_structure``). V1 scores, scale (C /
heads)^-1/2; attention dropout in the kernels; proj, its dropout, merge, roll back, crop.
The roll and partition are PyTorch's (no 3-D window map in the kernels).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.dispatch import exporting
from ...ops.position_bias import TableBias
from .base import inference_cache
from .rel_pos import _kept
from .tv_swin import TvSwinAdapter, module_shift_mask


def _video_swin():
    try:
        from torchvision.models.video import swin_transformer
    except ImportError:  # pragma: no cover - timm requires torchvision
        return None
    return swin_transformer


def shift_mask_3d(frames: int, height: int, width: int, window: Tuple[int, int, int], shift: Tuple[int, int, int],
                  device: torch.device) -> torch.Tensor:
    """torchvision's 3-D shift mask of a padded (frames, height, width) clip, (nW, N, N)
    float32 0 / -100 (its own function; it takes a tensor only for the dtype and device)."""
    return _video_swin()._compute_attention_mask_3d(torch.empty(0, device=device), (frames, height, width), window,
                                                    shift)


@torch.compiler.assume_constant_result
def _constant_mask_3d(frames: int, height: int, width: int, wd: int, wh: int, ww: int, sd: int, sh: int, sw: int,
                      device: torch.device) -> Tuple[torch.Tensor]:
    """``(shift_mask_3d(...),)`` as a constant of a graph torch.compile traces (a tuple:
    ``tv_swin._constant_mask_2d`` says why)."""
    return (shift_mask_3d(frames, height, width, (wd, wh, ww), (sd, sh, sw), device),)


@torch.compiler.assume_constant_result
def _constant_index_slice(index: torch.Tensor, tokens: int) -> Tuple[torch.Tensor]:
    """``(index[:tokens, :tokens],)`` as a constant of a graph torch.compile traces (dynamo
    calls it with the index buffer's value), whose pairs are then sorted when it traces."""
    return (index[:tokens, :tokens].contiguous(),)


class TvSwin3dAdapter(TvSwinAdapter):
    family = "tv_swin3d"
    required = TvSwinAdapter.required

    @staticmethod
    def module_type() -> Optional[Type[nn.Module]]:
        module = _video_swin()
        return getattr(module, "ShiftedWindowAttention3d", None)

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if not hasattr(_video_swin(), "_compute_attention_mask_3d"):
            import torchvision
            return f"torchvision {torchvision.__version__}: video.swin_transformer has no _compute_attention_mask_3d"
        reason = super().unsupported(module)
        if reason is None and len(module.window_size) != 3:
            return f"window_size {list(module.window_size)} is not 3-D"
        return reason

    def window_bias(self, module: nn.Module, tokens: int) -> Union[TableBias, torch.Tensor]:
        """The bias of windows of ``tokens`` tokens: the table gathered by the index's first
        ``tokens`` rows and columns (all of it for the module's own window)."""
        table, index = module.relative_position_bias_table, module.relative_position_index
        constant = not exporting()
        if tokens != index.shape[0]:
            if torch.compiler.is_compiling() and constant:
                index = _constant_index_slice(index, tokens)[0].view(tokens, tokens)
            else:
                full = index
                index = _kept(module, f"index_{tokens}", (full,), lambda: full[:tokens, :tokens].contiguous())
        return inference_cache(module, (table, index), lambda: TableBias(table, index, constant_index=constant))

    def forward(self, module: nn.Module, x: torch.Tensor, unused=None) -> torch.Tensor:
        """Replacement of the module's forward: x (B, T, H, W, C) -> (B, T, H, W, C)."""
        in_features = self.in_features(module)
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[-1] != in_features:
            raise ValueError(f"{type(module).__name__}: expected x of shape (B, T, H, W, C = {in_features}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        batch, *size, channels = x.shape
        window, shift = list(module.window_size), list(module.shift_size)
        for i in range(3):  # torchvision's _get_window_and_shift_size
            if size[i] <= window[i]:
                window[i], shift[i] = size[i], 0
        window, shift = tuple(window), tuple(shift)
        tokens = math.prod(window)
        pad = [(w - s % w) % w for s, w in zip(size, window)]
        if any(pad):
            x = F.pad(x, (0, 0, 0, pad[2], 0, pad[1], 0, pad[0]))
        padded = tuple(s + p for s, p in zip(size, pad))
        shifted = sum(shift) > 0
        if shifted:
            x = torch.roll(x, shifts=tuple(-s for s in shift), dims=(1, 2, 3))
        counts = [p // w for p, w in zip(padded, window)]
        windows = x.view(batch, counts[0], window[0], counts[1], window[1], counts[2], window[2], channels)
        windows = windows.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, tokens, channels)
        mask = (module_shift_mask(module, shift_mask_3d, _constant_mask_3d, padded, window, shift, x.device)
                if shifted else None)
        out = self._project(module, windows, mask, bias=self.window_bias(module, tokens))
        out = out.view(batch, *counts, *window, -1).permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(batch, *padded, -1)
        if shifted:
            out = torch.roll(out, shifts=shift, dims=(1, 2, 3))
        if any(pad):
            out = out[:, :size[0], :size[1], :size[2]].contiguous()
        return out
