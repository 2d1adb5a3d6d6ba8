"""The layouts the window kernels read qkv in: the partitioned windows (B_, N, 3*H*D) or
(B_, N, 3, H, D), a feature map (B, H*W, 3*H*D) cut by a ``FeatureMap`` (``WindowGrid``), and
keys and values (B_, N, 2, H, D) beside a query tensor that an image's windows share; and the
kernels' arguments that say which (``tiles.window_rows``, ``tiles.query_base``)."""
from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch


class FeatureMap(Protocol):
    """What the kernels read of a feature-map layout (``ops.window_grid.WindowGrid`` is one):
    the map's height and width, its windows per image and tokens per window, whether they are
    strided grid windows, the window's (height, width), and the run-time arguments
    ``tiles.window_rows`` takes. Hashable: part of a call's description (``call.WindowCall``)."""

    height: int
    width: int
    num_windows: int
    tokens: int
    strided: bool
    window: Tuple[int, int]

    def kernel_args(self) -> Tuple[int, ...]: ...


def windows_tokens_channels(qkv: torch.Tensor, grid: Optional[FeatureMap]) -> Tuple[int, int, int]:
    """(B_, N, 3*H*D) of qkv in the partitioned layout ((B_, N, 3*H*D) or (B_, N, 3, H, D), or
    (B_, N, 2, H, D): keys and values, the queries a tensor of their own, ``call.IMAGE_MAJOR_QUERY``),
    or in the feature-map layout (B, H*W, 3*H*D) of ``grid``: B_ = B * nW."""
    if grid is None:
        return qkv.shape[0], qkv.shape[1], qkv.shape[2] if qkv.dim() == 3 else 3 * qkv.shape[3] * qkv.shape[4]
    return qkv.shape[0] * grid.num_windows, grid.tokens, qkv.shape[2]


def grid_args(grid: Optional[FeatureMap]) -> Tuple[int, ...]:
    """The layout's run-time arguments (``tiles.window_rows``): the feature-map geometry,
    placeholders for the partitioned layout."""
    return grid.kernel_args() if grid is not None else (1, 1, 1, 1, 0, 0)


def layout_flags(grid: Optional[FeatureMap]) -> dict:
    """The constexprs of the layout (``tiles.window_rows``): MAPPED, 0 partitioned, 1 the
    feature map's block windows, 2 its strided grid windows; the window's width."""
    if grid is None:
        return dict(MAPPED=0, WINDOW_W=1)
    return dict(MAPPED=2 if grid.strided else 1, WINDOW_W=grid.window[1])
