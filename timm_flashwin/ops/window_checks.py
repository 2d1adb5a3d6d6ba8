"""``window_attention``'s argument checks: each bad argument raises a TypeError or
ValueError naming it and what was expected (``validate``); and a valid call's arguments as the
kernels read them (``keys_values_query``, ``bias_parts``), which the op describes the call by."""
from __future__ import annotations

import math
from numbers import Real
from typing import Optional, Tuple, Union

import torch

from .dispatch import KERNEL_DTYPES
from ..kernels.window.call import DENSE_BIAS, NO_BIAS, TABLE_BIAS
from .position_bias import TableBias, check_sigmoid_scale
from .window_grid import WindowGrid

#: the op's limits: tokens per window and head dims that its kernels' plans take (the adapters
#: leave modules beyond them to timm's forward)
MAX_TOKENS = 2048
MAX_HEAD_DIM = 256


def _fail(exc, argument: str, expected: str, got) -> None:
    raise exc(f"window_attention: `{argument}` must be {expected}, got {got}")


def bias_parts(bias: Union[torch.Tensor, TableBias, None]) -> Tuple[int, Optional[torch.Tensor],
                                                                  Optional[torch.Tensor], float]:
    """A valid ``bias`` as a call's description and tensors hold it: (its kind, the tensor the
    kernels read, a ``TableBias``'s index, its sigmoid scale or 0): a dense (H, N, N) bias (a
    (1, H, N, N) one's first), or a ``TableBias``'s table (T, H) and (N, N) index."""
    if isinstance(bias, TableBias):
        return TABLE_BIAS, bias.table, bias.index, float(bias.sigmoid_scale) if bias.sigmoid_scale is not None else 0.0
    if bias is None:
        return NO_BIAS, None, None, 0.0
    return DENSE_BIAS, bias[0] if bias.dim() == 4 else bias, None, 0.0


def _check_tensor(name: str, t, ndims: Tuple[int, ...], qkv: torch.Tensor, float_dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dim() not in ndims:
        _fail(ValueError, name, f"a tensor of rank {' or '.join(map(str, ndims))}", f"shape {tuple(t.shape)}")
    if t.dtype not in float_dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in float_dtypes)
        _fail(TypeError, name, f"of dtype {names}", t.dtype)
    if t.device != qkv.device:
        _fail(ValueError, name, f"on qkv's device {qkv.device}", t.device)


def validate(qkv, num_heads, bias, mask, scale, logit_scale, dropout_p, grid=None, query=None,
             query_order="image_major") -> Tuple[int, int, int]:
    """(B_, N, head_dim) of a valid call, else a TypeError or ValueError naming the argument.
    With ``query`` (B, N, H*D), the queries of B images, qkv (B_, N, 2*H*D) holds keys and values."""
    if not isinstance(qkv, torch.Tensor):
        _fail(TypeError, "qkv", "a torch.Tensor", type(qkv).__name__)
    if grid is not None and not isinstance(grid, WindowGrid):
        _fail(TypeError, "grid", "a WindowGrid or None", type(grid).__name__)
    if query is not None:
        if grid is not None:
            raise ValueError("window_attention: `query` takes the partitioned layout, not `grid`")
        if query_order not in ("image_major", "tiled"):
            _fail(ValueError, "query_order", '"image_major" or "tiled"', repr(query_order))
        if qkv.dim() != 3:
            _fail(ValueError, "qkv", "with `query`, a 3-D tensor (B_, N, 2*H*D) of keys and values",
                  f"shape {tuple(qkv.shape)}")
    elif qkv.dim() != 3 and (grid is not None or qkv.dim() != 5):
        _fail(ValueError, "qkv", "a 3-D tensor (B_, N, 3*H*D) or a 5-D one (B_, N, 3, H, D)" if grid is None
              else "a 3-D tensor (B, H*W, 3*H*D)", f"shape {tuple(qkv.shape)}")
    if qkv.dtype not in KERNEL_DTYPES + (torch.float64,):
        _fail(TypeError, "qkv", "float16, bfloat16, float32 or float64", qkv.dtype)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        _fail(ValueError, "num_heads", "a positive int", repr(num_heads))
    if qkv.dim() == 5 and (qkv.shape[2] != 3 or qkv.shape[3] != num_heads):
        _fail(ValueError, "qkv", f"of shape (B_, N, 3, H, D) with H = num_heads = {num_heads}",
              f"shape {tuple(qkv.shape)}")
    if grid is None:  # (B_, N, 3*H*D), or (B_, N, 3, H, D)
        num_windows, n = qkv.shape[:2]
        channels = qkv.shape[2] if qkv.dim() == 3 else 3 * qkv.shape[3] * qkv.shape[4]
    else:
        if qkv.shape[1] != grid.height * grid.width:
            _fail(ValueError, "qkv", f"of shape (B, H*W, 3*H*D) with H*W = {grid.height}*{grid.width} (grid)",
                  f"shape {tuple(qkv.shape)}")
        num_windows, n, channels = qkv.shape[0] * grid.num_windows, grid.tokens, qkv.shape[2]
    projections = 2 if query is not None else 3  # q, k, v in qkv, or k and v
    if channels % (projections * num_heads):
        _fail(ValueError, "qkv", f"a last dim divisible by {projections} * num_heads = {projections * num_heads}",
              channels)
    head_dim = channels // (projections * num_heads)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        _fail(ValueError, "qkv", f"a head_dim (last dim / ({projections} * num_heads)) in [1, {MAX_HEAD_DIM}]",
              head_dim)
    if not 1 <= n <= MAX_TOKENS:
        _fail(ValueError, "qkv", f"a token count N in [1, {MAX_TOKENS}]", n)
    if query is not None:
        _check_query(query, qkv, num_windows, n, num_heads * head_dim)
    # Parameters may stay float32 under autocast, or match qkv's dtype.
    param_dtypes = tuple(dict.fromkeys((qkv.dtype, torch.float32)))
    if isinstance(bias, TableBias):
        _check_tensor("bias.table", bias.table, (2,), qkv, param_dtypes)
        if bias.table.shape[1] != num_heads:
            _fail(ValueError, "bias.table", f"of shape (T, H) with H = num_heads = {num_heads}",
                  f"shape {tuple(bias.table.shape)}")
        index = bias.index
        if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype.is_complex:
            _fail(TypeError, "bias.index", "an integer torch.Tensor",
                  index.dtype if isinstance(index, torch.Tensor) else type(index).__name__)
        if tuple(index.shape) != (n, n):
            _fail(ValueError, "bias.index", f"of shape (N, N) = {(n, n)}", f"shape {tuple(index.shape)}")
        if index.device != qkv.device:
            _fail(ValueError, "bias.index", f"on qkv's device {qkv.device}", index.device)
        check_sigmoid_scale(bias.sigmoid_scale, "window_attention")
    elif bias is not None:
        _check_tensor("bias", bias, (3, 4), qkv, param_dtypes)
        if tuple(bias.shape[-3:]) != (num_heads, n, n) or (bias.dim() == 4 and bias.shape[0] != 1):
            _fail(ValueError, "bias", f"of shape (H, N, N) = {(num_heads, n, n)} or (1, H, N, N)",
                  f"shape {tuple(bias.shape)}")
    if mask is not None:
        _check_tensor("mask", mask, (3,), qkv, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
        if tuple(mask.shape[1:]) != (n, n) or mask.shape[0] < 1:
            _fail(ValueError, "mask", f"of shape (nW, N, N) with N = {n}", f"shape {tuple(mask.shape)}")
        if num_windows % mask.shape[0]:
            _fail(ValueError, "mask", f"of shape (nW, N, N) with nW dividing B_ = {num_windows}",
                  f"nW = {mask.shape[0]}")
    if (scale is None) == (logit_scale is None):
        raise TypeError("window_attention: give exactly one of `scale` (V1 attention) or "
                        "`logit_scale` (cosine attention)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)):
        _fail(TypeError, "scale", "a Python float", type(scale).__name__)
    if scale is not None and not abs(scale) < math.inf:  # NaN too; traceable where a float is symbolic
        _fail(ValueError, "scale", "finite", scale)  # as the local operators'
    # logit_scale's values are not read here (a read to the host at every call): the kernels
    # clamp and exponentiate them as timm does (+inf gives 100, -inf uniform attention, NaN
    # a NaN head: tests/test_op_edge_cases.py)
    if logit_scale is not None:
        _check_tensor("logit_scale", logit_scale, (1, 3, 4), qkv, param_dtypes)
        if logit_scale.numel() != num_heads:
            _fail(ValueError, "logit_scale", f"a tensor with num_heads = {num_heads} elements",
                  f"shape {tuple(logit_scale.shape)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real) or not 0.0 <= dropout_p < 1.0:
        _fail(ValueError, "dropout_p", "a float in [0, 1)", repr(dropout_p))
    return num_windows, n, head_dim


def _check_query(query, qkv: torch.Tensor, num_windows: int, n: int, channels: int) -> None:
    """``query``: (B, N, H*D) with B dividing B_, qkv's dtype and device."""
    if not isinstance(query, torch.Tensor):
        _fail(TypeError, "query", "a torch.Tensor", type(query).__name__)
    if query.dim() != 3 or query.shape[1:] != (n, channels) or query.shape[0] < 1 or num_windows % query.shape[0]:
        _fail(ValueError, "query", f"of shape (B, N, H*D) = (B, {n}, {channels}) with B dividing qkv's "
              f"B_ = {num_windows}", f"shape {tuple(query.shape)}")
    if query.dtype != qkv.dtype:
        _fail(TypeError, "query", f"of qkv's dtype {qkv.dtype}", query.dtype)
    if query.device != qkv.device:
        _fail(ValueError, "query", f"on qkv's device {qkv.device}", query.device)


def keys_values_query(kv: torch.Tensor, query: torch.Tensor, num_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """kv (B_, N, 2*H*D) and query (B, N, H*D), validated, as the kernels read them: kv as a
    (B_, N, 2, H, D) view, and the two with one channel stride (the kernels read the heads
    and channels of both with kv's: ``launch.query_args``), made so by a copy where not."""
    if query.stride(2) != kv.stride(2):
        query = query.contiguous()
        if kv.stride(2) != 1:
            kv = kv.contiguous()
    return kv.unflatten(2, (2, num_heads, kv.shape[2] // (2 * num_heads))), query
