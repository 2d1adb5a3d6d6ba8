"""timm's window-attention math, written once, in plain PyTorch.

This file is the oracle of the test-suite (run it in float64) and the path the op takes
where no Triton kernel can run (CPU tensors without ``TRITON_INTERPRET=1``, float64).
It follows timm 1.0.x line by line:

* ``swin_transformer.WindowAttention``:      S = scale * q @ k^T
* ``swin_transformer_v2.WindowAttention`` and
  ``swin_transformer_v2_cr.WindowMultiHeadAttention``:
                                             S = exp(min(logit_scale, ln 100)) * q^ @ k^^T,
                                             q^ = F.normalize(q, dim=-1)

    O = dropout(softmax(S + B[h] + M[b mod nW])) @ V
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.window.tiles import LOGIT_SCALE_MAX_VALUE as LOGIT_SCALE_MAX



def shared_query_qkv(kv: torch.Tensor, query: torch.Tensor, tiled: bool) -> torch.Tensor:
    """(B_, N, 3, H, D): each window's queries beside its keys and values, kv (B_, N, 2, H, D),
    from query (B, N, H*D), one per image, as timm's GCViT gives them to its windows:
    ``repeat_interleave`` (window b takes image b // (B_ / B)) or, ``tiled``, ``repeat``
    (image b % B). ``window_attention(..., query=)`` without the copy."""
    windows, images = kv.shape[0], query.shape[0]
    q = query.reshape(images, kv.shape[1], 1, *kv.shape[3:])
    q = q.repeat(windows // images, 1, 1, 1, 1) if tiled else q.repeat_interleave(windows // images, 0)
    return torch.cat((q, kv), dim=2)


def window_attention_reference(
    qkv: torch.Tensor,
    num_heads: int,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    logit_scale: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_factor: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Window attention from the qkv linear output, with timm's exact operations.

    Args:
        qkv: (B_, N, 3*H*D), the output of the module's qkv linear, or a (B_, N, 3, H, D)
            view of it (``window_attention``'s).
        num_heads: H.
        bias: (H, N, N) relative-position bias, or None.
        mask: (nW, N, N) additive mask for window ``b % nW``, or None. B_ % nW == 0.
        scale: the V1 score scale (``head_dim ** -0.5``); exclusive with ``logit_scale``.
        logit_scale: H values (any shape with H elements); selects cosine attention.
        dropout_p: attention dropout on the probabilities, ``F.dropout`` as timm's
            attn_drop applies it, when > 0 and no ``dropout_factor`` is given.
        dropout_factor: (B_, H, N, N) keep / (1 - p) to multiply the probabilities by
            instead: the tests pass the kernels' own mask (kernels/window/dropout.py).

    Returns:
        (B_, N, H*D) in ``qkv.dtype``. Reduced-precision inputs are computed in float32
        (as autocast would), float64 inputs in float64.
    """
    B_, N = qkv.shape[:2]
    H = num_heads
    D = qkv.shape[2:].numel() // (3 * H)
    compute_dtype = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    q, k, v = qkv.to(compute_dtype).reshape(B_, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)

    if logit_scale is not None:
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        head_scale = torch.clamp(logit_scale.to(compute_dtype).reshape(1, H, 1, 1), max=LOGIT_SCALE_MAX).exp()
        attn = attn * head_scale
    else:
        attn = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:
        attn = attn + bias.to(compute_dtype).reshape(1, H, N, N)
    if mask is not None:
        num_win = mask.shape[0]
        attn = attn.view(-1, num_win, H, N, N) + mask.to(compute_dtype).unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, H, N, N)
    attn = attn.softmax(dim=-1)
    if dropout_factor is not None:
        attn = attn * dropout_factor.to(compute_dtype)
    elif dropout_p > 0:
        attn = F.dropout(attn, dropout_p, training=True)
    out = (attn @ v).transpose(1, 2).reshape(B_, N, H * D)
    return out.to(qkv.dtype)
