"""How a Swin block cuts its feature map into windows, as row numbers.

timm's blocks roll the (B, H, W, C) map by -shift, partition it into (H / wh) * (W / ww)
windows of wh * ww tokens (row-major, windows and tokens alike), attend within each window,
merge the windows back and roll by +shift: four copies forward and four backward around
the attention, each of the whole map. ``WindowGrid`` describes that cut: the kernels
compute each window token's row of the map from it (``kernel_args``,
``kernels.window.tiles.window_rows``) and read qkv and write their output and gradients there
(``window_attention(..., grid=)``), so that the copies are not made; ``token_map`` says the
same as a table (window w's token t is row token_map[w, t] of the image's H * W rows), with
which ``partition`` and ``merge`` make the copies where the kernels cannot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from .dispatch import exporting, no_dispatch_mode

#: (grid, device) -> (the map rows of the windows' tokens in window order (H*W,) int64, the
#: inverse permutation (H*W,) int64)
_MAPS: Dict[Tuple["WindowGrid", torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}


def _pair(name: str, value, minimum: int) -> Tuple[int, int]:
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in value)):
        raise ValueError(f"WindowGrid: `{name}` must be a pair of ints >= {minimum}, got {value!r}")
    return int(value[0]), int(value[1])


@dataclass(frozen=True)
class WindowGrid:
    """A (height, width) feature map cut into windows of ``window`` = (wh, ww) tokens after
    a cyclic shift by -``shift`` (timm's ``torch.roll(x, -shift)``), as timm's Swin blocks
    (V1, V2, V2-CR) and MaxViT's block attention cut theirs; or, ``strided``, into MaxViT's
    grid windows (timm's ``grid_partition``): window (wy, wx) of the (H / wh, W / ww)
    windows takes the tokens (i * H / wh + wy, j * W / ww + wx), i < wh, j < ww, spread over
    the whole map. height and width must be multiples of the window (timm pads otherwise,
    and its padded tokens take part in the attention: not a permutation), and 0 <= shift <
    window (0 where strided).
    """

    height: int
    width: int
    window: Tuple[int, int]
    shift: Tuple[int, int] = (0, 0)
    strided: bool = False

    def __post_init__(self):
        for name in ("height", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WindowGrid: `{name}` must be a positive int, got {value!r}")
        window, shift = _pair("window", self.window, 1), _pair("shift", self.shift, 0)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "shift", shift)
        if self.height % window[0] or self.width % window[1]:
            raise ValueError(f"WindowGrid: the map ({self.height}, {self.width}) must be a multiple of `window` "
                             f"{window}")
        if shift[0] >= window[0] or shift[1] >= window[1]:
            raise ValueError(f"WindowGrid: `shift` must be below the window {window}, got {shift}")
        if not isinstance(self.strided, bool):
            raise ValueError(f"WindowGrid: `strided` must be a bool, got {self.strided!r}")
        if self.strided and shift != (0, 0):
            raise ValueError(f"WindowGrid: strided (grid) windows take no shift, got {shift}")

    @property
    def num_windows(self) -> int:
        """nW, windows per image."""
        return (self.height // self.window[0]) * (self.width // self.window[1])

    @property
    def tokens(self) -> int:
        """N, tokens per window."""
        return self.window[0] * self.window[1]

    def token_map(self, device: torch.device) -> torch.Tensor:
        """(nW, N) int32, contiguous: the map row (y * width + x) of each window's tokens."""
        return self._maps(device)[0].view(self.num_windows, self.tokens).to(torch.int32)

    def kernel_args(self) -> Tuple[int, int, int, int, int, int]:
        """(nW, windows per map row, H, W, shift_h, shift_w): the kernels' arguments for this
        grid (``kernels.window.tiles.window_rows``)."""
        return (self.num_windows, self.width // self.window[1], self.height, self.width, *self.shift)

    def partition(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H*W, C) -> (B*nW, N, C): timm's roll by -shift and window partition (a gather;
        its gradient a gather too)."""
        index, inverse = self._maps(x.device)
        return _PermuteRows.apply(x, index, inverse).view(-1, self.tokens, x.shape[-1])

    def merge(self, windows: torch.Tensor) -> torch.Tensor:
        """(B*nW, N, C) -> (B, H*W, C): timm's window merge and roll by +shift (a gather;
        its gradient a gather too)."""
        index, inverse = self._maps(windows.device)
        rows = windows.reshape(-1, self.num_windows * self.tokens, windows.shape[-1])
        return _PermuteRows.apply(rows, inverse, index)

    def _maps(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            if exporting():  # torch.export: the exported graph computes them
                return self._compute_maps(device)
            return _constant_maps(self.height, self.width, *self.window, *self.shift, self.strided, device)
        if not no_dispatch_mode():  # under FakeTensorMode they would be fake: kept, later calls would read them
            return self._compute_maps(device)
        maps = _MAPS.get((self, device))
        if maps is None:
            # made outside inference mode: maps kept by a call under torch.inference_mode serve
            # later training calls too, whose partition saves the inverse for its backward (an
            # inference tensor cannot be saved)
            with torch.inference_mode(False):
                maps = _MAPS[(self, device)] = self._compute_maps(device)
        return maps

    def _compute_maps(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(index, inverse), both (H*W,) int64: ``index[k]``, the map row of window-order
        token k; ``inverse[p]``, the window-order token of map row p. Index arithmetic only
        (no argsort): where a compiled graph computes them, inductor folds it into the
        gathers that read them."""
        (wh, ww), (sh, sw) = self.window, self.shift
        height, width = self.height, self.width
        r, c = torch.arange(height, device=device), torch.arange(width, device=device)
        if self.strided:  # window (wy, wx)'s token (i, j) at (i * nWy + wy, j * nWx + wx)
            windows_y, windows_x = height // wh, width // ww
            rows = r[:, None] * width + c[None, :]  # (H, W) = (wh, nWy, ww, nWx)
            index = rows.view(wh, windows_y, ww, windows_x).permute(1, 3, 0, 2).reshape(-1)
            # map row (y, x) is window (y % nWy, x % nWx)'s token (y // nWy, x // nWx)
            window_of = (r % windows_y)[:, None] * windows_x + (c % windows_x)[None, :]
            inverse = window_of * (wh * ww) + (r // windows_y)[:, None] * ww + (c // windows_x)[None, :]
            return index, inverse.reshape(-1)
        # shifted position p reads the map at (p + shift) mod size, as torch.roll(x, -shift) does
        y, x = (r + sh) % height, (c + sw) % width
        rows = (y[:, None] * width + x[None, :])  # (H, W): map row of each shifted position
        index = rows.view(height // wh, wh, width // ww, ww).permute(0, 2, 1, 3).reshape(-1)
        # map row (r, c) holds shifted position ((r - sh) mod H, (c - sw) mod W)
        ys, xs = (r - sh) % height, (c - sw) % width
        window_of = (ys // wh)[:, None] * (width // ww) + (xs // ww)[None, :]
        inverse = window_of * (wh * ww) + (ys % wh)[:, None] * ww + (xs % ww)[None, :]
        return index, inverse.reshape(-1)


@torch.compiler.assume_constant_result
def _constant_maps(height: int, width: int, wh: int, ww: int, sh: int, sw: int, strided: bool,
                   device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``WindowGrid._compute_maps`` as constants of a graph torch.compile traces (dynamo
    calls it with the grid's ints). Where a graph computes them (under torch.export,
    ``WindowGrid._maps``), they are index arithmetic only, which inductor folds into the
    gathers that read them."""
    return WindowGrid(height, width, (wh, ww), (sh, sw), strided)._compute_maps(device)


class _PermuteRows(torch.autograd.Function):
    """x.index_select(1, index) for a permutation ``index`` of x's rows, whose gradient is
    the gather by its ``inverse``: index_select's own backward adds into zeros with
    index_add_, which on CUDA adds atomically (its order varies) and which
    ``torch.use_deterministic_algorithms(True)`` refuses. Its context set apart from its
    forward (``setup_context``), as torch.func's transforms require."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _x, _index, inverse = inputs
        ctx.save_for_backward(inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, = ctx.saved_tensors
        return grad.index_select(1, inverse), None, None
