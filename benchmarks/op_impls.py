"""The window-attention implementations ``bench_op.py`` sets side by side, on one case's
inputs (timm's shift mask, the relative-position table): timm's eager math, its SDPA path,
torch.compile of the eager math, FlexAttention, ours, and the published Flash Window
Attention kernels (``--published DIR``)."""
from __future__ import annotations

import math
import os
import sys
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's library
from timm_flashwin import window_attention  # noqa: E402
from timm_flashwin.ops.position_bias import gather_position_bias  # noqa: E402
from timm_flashwin.ops.reference import LOGIT_SCALE_MAX  # noqa: E402


# (B_, H, N, D, nW): nW windows per image at the model's native resolution (0: no shift mask)
SHAPES = {
    "v1_s1_b64": (4096, 3, 49, 32, 64),
    "v1_s3_b64": (256, 12, 49, 32, 4),
    "w8_s1_b64": (4096, 3, 64, 32, 64),
    "w12_s1_b32": (512, 4, 144, 32, 16),  # not in the list: window 12 (SwinV2 *_window12_*)
    "w16_s1_b32": (512, 3, 256, 32, 16),
    "w24_s1_b16": (256, 4, 576, 32, 16),
    # the other families at 224, batch 64: MaxViT-tiny's stage 1, TinyViT-21m's stage 2, CoAtNet-0's stage 3
    "maxvit_s1_b64": (4096, 2, 49, 32, 0),
    "tinyvit_s2_b64": (1024, 6, 49, 32, 0),
    "coatnet_s3_b64": (64, 12, 196, 32, 0),
}
IMPLS = ["eager", "sdpa", "compile", "flex", "ours"]
PUBLISHED = {"fwa": "v1", "fwa2": "cosine"}  # the published kernels, and the one kind each computes
PUBLISHED_NO_MASK = {"fwa"}  # those that take no mask: their cases, and their reference, have none


def timm_mask(num_windows: int, n: int, device) -> torch.Tensor:
    """A shift mask with timm's 9-region structure (0 / -100)."""
    side = int(round(math.sqrt(num_windows)))
    win = int(round(math.sqrt(n)))
    assert side * side == num_windows and win * win == n
    size, shift = side * win, win // 2
    img = torch.zeros(size, size, device=device)
    cnt = 0
    for hs in (slice(0, -win), slice(-win, -shift), slice(-shift, None)):
        for ws in (slice(0, -win), slice(-win, -shift), slice(-shift, None)):
            img[hs, ws] = cnt
            cnt += 1
    windows = img.view(side, win, side, win).permute(0, 2, 1, 3).reshape(num_windows, n)
    diff = windows[:, None, :] - windows[:, :, None]
    return torch.where(diff != 0, -100.0, 0.0)


def make_inputs(shape, cosine: bool, device="cuda", masked: bool = True):
    windows, heads, n, head_dim, num_windows = shape
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(windows, n, 3 * heads * head_dim, device=device, dtype=torch.bfloat16,
                      generator=g).requires_grad_()
    win = math.isqrt(n)
    bias = torch.randn((2 * win - 1) ** 2, heads, device=device, generator=g).requires_grad_()  # the table
    logit_scale = torch.log(torch.full((heads,), 20.0, device=device)).requires_grad_() if cosine else None
    mask = timm_mask(num_windows, n, device) if masked and num_windows else None
    grad = torch.randn(windows, n, heads * head_dim, device=device, dtype=torch.bfloat16, generator=g)
    return dict(qkv=qkv, bias=bias, logit_scale=logit_scale, mask=mask, heads=heads, head_dim=head_dim,
                scale=head_dim ** -0.5, grad=grad)


def _split(qkv, heads):
    windows, n, c = qkv.shape
    return qkv.reshape(windows, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


_INDEX: Dict = {}


def relative_position_index(n: int, device) -> torch.Tensor:
    """timm's relative_position_index (N, N) of a square W x W window: made once, as timm
    keeps it in a buffer."""
    if (n, str(device)) not in _INDEX:
        win = math.isqrt(n)
        y, x = torch.meshgrid(torch.arange(win, device=device), torch.arange(win, device=device), indexing="ij")
        y, x = y.flatten(), x.flatten()
        index = (y[:, None] - y[None, :] + win - 1) * (2 * win - 1) + (x[:, None] - x[None, :] + win - 1)
        _INDEX[(n, str(device))] = index  # (N, N), one tensor: gather_position_bias keeps its sorted rows on it
    return _INDEX[(n, str(device))]


def dense_bias(table, n):
    """timm's gather of the (H, N, N) bias from the table ((2W-1)^2, H), every call, made
    contiguous as timm's ``_get_rel_pos_bias`` does."""
    return table[relative_position_index(n, table.device).view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()


def eager_math(qkv, table, mask, logit_scale, heads, scale):
    """timm's modules, verbatim in substance."""
    windows, n, _ = qkv.shape
    bias = dense_bias(table, n)
    q, k, v = _split(qkv, heads)
    if logit_scale is not None:
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(logit_scale.reshape(1, heads, 1, 1), max=LOGIT_SCALE_MAX).exp()
    else:
        attn = (q * scale) @ k.transpose(-2, -1)
    attn = attn + bias.unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        attn = attn.view(-1, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, heads, n, n).softmax(-1)
    return (attn @ v).transpose(1, 2).reshape(windows, n, -1)


def sdpa_math(qkv, table, mask, logit_scale, heads, scale):
    """timm V1's fused path (and its cosine analogue): SDPA with a dense attn_mask."""
    windows, n, _ = qkv.shape
    bias = dense_bias(table, n)
    q, k, v = _split(qkv, heads)
    if logit_scale is not None:
        s = torch.clamp(logit_scale, max=LOGIT_SCALE_MAX).exp().reshape(1, heads, 1, 1)
        q = F.normalize(q, dim=-1) * s
        k = F.normalize(k, dim=-1)
        scale = 1.0
    if mask is None:
        attn_mask = bias.unsqueeze(0)
    else:
        nw = mask.shape[0]
        attn_mask = bias.unsqueeze(0) + mask.view(1, nw, 1, n, n).expand(windows // nw, -1, heads, -1, -1).reshape(
            -1, heads, n, n)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.transpose(1, 2).reshape(windows, n, -1)


_flex = None


def flex_math(qkv, table, mask, logit_scale, heads, scale):
    global _flex
    from torch.nn.attention.flex_attention import flex_attention
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    windows, n, _ = qkv.shape
    q, k, v = _split(qkv, heads)
    win = math.isqrt(n)

    def bias_mask(b, h, qi, ki):  # timm's relative_position_index, computed from the token coordinates
        bias = table[(qi // win - ki // win + win - 1) * (2 * win - 1) + (qi % win - ki % win + win - 1), h]
        return bias if mask is None else bias + mask[b % mask.shape[0], qi, ki]

    if logit_scale is not None:
        s = torch.clamp(logit_scale, max=LOGIT_SCALE_MAX).exp()
        q, k, scale = F.normalize(q, dim=-1), F.normalize(k, dim=-1), 1.0

        def score_mod(score, b, h, qi, ki):
            return score * s[h] + bias_mask(b, h, qi, ki)
    else:
        def score_mod(score, b, h, qi, ki):
            return score + bias_mask(b, h, qi, ki)
    out = _flex(q, k, v, score_mod=score_mod, scale=scale)
    return out.transpose(1, 2).reshape(windows, n, -1)


def ours(qkv, table, mask, logit_scale, heads, scale):
    """As the adapters run it: the bias gathered by gather_position_bias."""
    kwargs = dict(logit_scale=logit_scale) if logit_scale is not None else dict(scale=scale)
    bias = gather_position_bias(table, relative_position_index(qkv.shape[1], qkv.device))
    return window_attention(qkv, heads, bias=bias, mask=mask, **kwargs)


def fwa_math(qkv, table, mask, logit_scale, heads, scale):
    """Flash Window Attention (``flash_swin_attn_func(q, k, v, bias, scale_qk)``) as its README
    calls it: contiguous (B_, H, N, D) q, k, v, the (H, N, N) bias, q scaled beforehand with
    scale_qk = 1 (its backward does not scale dq); no mask. Its backward reads the output's
    gradient as if contiguous, which timm's transpose hands back not: a hook makes it so
    (a copy, in its time; without it every gradient was wrong, relative errors 1.3 to 1.6)."""
    if mask is not None:
        raise ValueError("flash_swin_attn takes no mask: run its cases without one")
    from flash_swin_attn import flash_swin_attn_func
    windows, n, _ = qkv.shape
    q, k, v = _split(qkv, heads)
    out = flash_swin_attn_func((q * scale).contiguous(), k.contiguous(), v.contiguous(), dense_bias(table, n), 1.0)
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous())
    return out.transpose(1, 2).reshape(windows, n, -1)


def fwa2_math(qkv, table, mask, logit_scale, heads, scale):
    """Flash Window Attention V2 (``flash_win_attn_v2(q, k, v, logit_scale, bias, mask)``):
    (B_, H, N, D) views of qkv, the log logit scale (H, 1, 1) and the (H, N, N) bias in the
    inputs' dtype (it asserts that), the (nW, N, N) mask."""
    from flash_win_attn_v2 import flash_win_attn_v2
    windows, n, _ = qkv.shape
    q, k, v = _split(qkv, heads)
    out = flash_win_attn_v2(q, k, v, logit_scale.reshape(heads, 1, 1).to(q.dtype), dense_bias(table, n).to(q.dtype),
                            mask)
    return out.transpose(1, 2).reshape(windows, n, -1)


_compiled: Dict[str, Callable] = {}


def implementation(name: str) -> Callable:
    if name == "compile" and "compile" not in _compiled:
        _compiled["compile"] = torch.compile(eager_math, dynamic=False)
    return dict(eager=eager_math, sdpa=sdpa_math, flex=flex_math, ours=ours, fwa=fwa_math, fwa2=fwa2_math,
                **_compiled)[name]
