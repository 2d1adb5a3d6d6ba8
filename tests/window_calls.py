"""Descriptions of window-attention calls (``kernels.window.call.WindowCall``) for tests and
build scripts that ask the plans about a shape without making its tensors."""
from __future__ import annotations

import torch

from timm_flashwin.kernels.arch import INTERPRETER, Arch
from timm_flashwin.kernels.window.call import NO_BIAS, OWN_QUERY, WindowCall, settings


def window_call(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool = False,
                arch: Arch = INTERPRETER, **fields) -> WindowCall:
    """A call of windows of ``n`` tokens at ``head_dim``: one window of one head, no bias, no
    mask, the settings as they are now, unless ``fields`` say otherwise."""
    call = WindowCall(windows=1, tokens=n, heads=1, head_dim=head_dim, dtype=dtype, arch=arch, bias=NO_BIAS,
                      sigmoid=0.0, periods=0, cosine=cosine, scale=1.0, dropout_p=0.5 if dropout else 0.0,
                      save_stats=True, grid=None, query=OWN_QUERY, settings=settings())
    return call._replace(**fields)
