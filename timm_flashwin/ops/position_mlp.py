"""Position-bias MLPs in one kernel forward and one backward: SwinV2's continuous position
bias table ``cpb_mlp(relative_coords_table)`` and SwinV2-CR's ``meta_mlp`` bias.

timm's SwinV2 modules compute their relative-position table with an MLP, Linear(2, K) ->
ReLU -> Linear(K, H, bias=False), on the (T, 2) log-spaced coordinates, in every training
step; SwinV2-CR's compute their whole (H, N, N) bias with timm's Mlp, Linear(2, K) -> ReLU
-> Dropout(0.125) -> Linear(K, H), on the (N^2, 2) log-spaced offsets of a window's token
pairs. ``position_mlp_table`` computes either with one kernel forward and one backward
(kernels/position/mlp.py) where PyTorch launches three to five and seven to nine (more
under autocast: each linear layer casts its weights), each with its autograd node (eager
training steps of the tiny models are bound by such host work, benchmarks/RESULTS.md). In
eager mode on plain tensors the kernels run through a ``torch.autograd.Function`` (no
operator dispatch), elsewhere as registered operators (torch.compile, dispatch modes,
tensor subclasses); on tensors the kernels do not take (plain CPU, float64) it is the
PyTorch expression. The table is fp32 (timm's autocast runs the MLP in bf16); the weight
gradients are in the weights' dtypes. ``fusable_cpb_mlp`` and ``fusable_meta_mlp`` say which
modules it computes exactly (the adapters keep timm's layers for others), and
``meta_mlp_dropout_mask`` draws SwinV2-CR's dropout mask as timm's layer draws it.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .hooks import runs_hooks
from ..kernels.position.launch import position_mlp_grads, position_mlp_table as _launch_table, split_position_mlp_grads
from .dispatch import (PLAIN_TENSOR_TYPES, call_operator, direct_launches, dispatch_free, no_dispatch_mode,
                       register_autograd, register_op, uses_kernels)


def _weight_grads(grad: torch.Tensor, coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                  b2: Optional[torch.Tensor], dropout_mask: Optional[torch.Tensor], dropout_p: float,
                  heads_first: bool, grads_op) -> Tuple[Optional[torch.Tensor], ...]:
    """(dw1, db1, dw2, db2 or None) in the weights' dtypes, ``grads_op`` computing their fp32
    vector from the table's gradient (its transpose where the table is heads-first)."""
    sums = grads_op(grad.t() if heads_first else grad, coords, w1, b1, w2, b2, dropout_mask, dropout_p)
    grads = split_position_mlp_grads(sums, w1.shape[0], w2.shape[0], b2 is not None)
    weights = (w1, b1, w2, b2) if b2 is not None else (w1, b1, w2)
    out = tuple(g.to(w.dtype) for g, w in zip(grads, weights))
    return out if b2 is not None else (*out, None)


class _PositionMLP(torch.autograd.Function):
    """The eager path: the operators' kernels without their dispatch."""

    @staticmethod
    def forward(ctx, coords, w1, b1, w2, b2, dropout_mask, dropout_p, heads_first):
        ctx.save_for_backward(coords, w1, b1, w2, b2, dropout_mask)
        ctx.dropout_p, ctx.heads_first = dropout_p, heads_first
        with direct_launches():
            return _launch_table(coords, w1, b1, w2, b2, dropout_mask, dropout_p, heads_first)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        with direct_launches():
            grads = _weight_grads(grad, *ctx.saved_tensors, ctx.dropout_p, ctx.heads_first, position_mlp_grads)
        return (None, *grads, None, None, None)


# ----------------------------------------------------------------- registered operators
def _table_fake(coords, w1, b1, w2, b2=None, dropout_mask=None, dropout_p=0.0, heads_first=False):
    # the defaults are the implementation's: the dispatcher leaves out arguments equal to them
    rows, heads = coords.shape[0], w2.shape[0]
    return coords.new_empty((heads, rows) if heads_first else (rows, heads), dtype=torch.float32)


def _grads_fake(grad, coords, w1, b1, w2, b2=None, dropout_mask=None, dropout_p=0.0):
    heads = w2.shape[0]
    return coords.new_empty(((3 + heads) * w1.shape[0] + (heads if b2 is not None else 0),), dtype=torch.float32)


position_mlp_table_op = register_op("position_mlp_table", _launch_table, _table_fake)
position_mlp_grads_op = register_op("position_mlp_grads", position_mlp_grads, _grads_fake)


def _setup_context(ctx, inputs, output):
    *tensors, dropout_p, heads_first = inputs
    ctx.save_for_backward(*tensors)
    ctx.dropout_p, ctx.heads_first = dropout_p, heads_first


def _backward(ctx, grad):
    grads = _weight_grads(grad, *ctx.saved_tensors, ctx.dropout_p, ctx.heads_first,
                          partial(call_operator, position_mlp_grads_op))
    return (None, *grads, None, None, None)


register_autograd(position_mlp_table_op, _backward, _setup_context)


# ----------------------------------------------------------------------- public functions
def _check(coords, w1, b1, w2, b2, dropout_mask, dropout_p) -> None:
    if coords.dim() != 2 or coords.shape[1] != 2 or coords.shape[0] < 1:
        raise ValueError(f"position_mlp_table: `coords` must be of shape (T, 2) with T >= 1, "
                         f"got {tuple(coords.shape)}")
    if (w1.dim() != 2 or b1.dim() != 1 or w2.dim() != 2 or w1.shape[1] != 2 or min(w1.shape[0], w2.shape[0]) < 1
            or b1.shape[0] != w1.shape[0] or w2.shape[1] != w1.shape[0]):
        raise ValueError(f"position_mlp_table: expected w1 (K, 2), b1 (K,), w2 (H, K) with K, H >= 1, got "
                         f"w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, w2 {tuple(w2.shape)}")
    if b2 is not None and tuple(b2.shape) != (w2.shape[0],):
        raise ValueError(f"position_mlp_table: `b2` must be of shape (H,) = ({w2.shape[0]},), got {tuple(b2.shape)}")
    if dropout_mask is not None and tuple(dropout_mask.shape) != (coords.shape[0], w1.shape[0]):
        raise ValueError(f"position_mlp_table: `dropout_mask` must be of shape (T, K) = "
                         f"{(coords.shape[0], w1.shape[0])}, got {tuple(dropout_mask.shape)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"position_mlp_table: `dropout_p` must be a float in [0, 1), got {dropout_p!r}")
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("dropout_mask", dropout_mask)):
        if t is not None and t.device != coords.device:
            raise ValueError(f"position_mlp_table: `{name}` must be on coords' device {coords.device}, got {t.device}")


def position_mlp_table(coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                       b2: Optional[torch.Tensor] = None, *, dropout_mask: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, heads_first: bool = False) -> torch.Tensor:
    """``dropout(relu(coords @ w1^T + b1)) @ w2^T + b2``, float32, from coords (T, 2), w1
    (K, 2), b1 (K,), w2 (H, K) and b2 (H,) or None: SwinV2's ``cpb_mlp`` (no dropout, no b2)
    or SwinV2-CR's ``meta_mlp`` applied to their coordinates. (T, H), or (H, T) where
    ``heads_first`` (SwinV2-CR's bias is the table's transpose, (H, N, N)).

    ``dropout_mask``: (T, K), any dtype, nonzero where a hidden unit is kept; the kept units
    are scaled by 1 / (1 - dropout_p), as PyTorch's dropout does (``meta_mlp_dropout_mask``
    draws it as timm's layer does). No dropout where it is None.

    The weights get gradients (fp32 sums, returned in their dtypes); coordinates that
    require a gradient (timm's are a buffer), and tensors the kernels do not take (plain
    CPU tensors, float64), go through the PyTorch expression, in the inputs' dtype."""
    _check(coords, w1, b1, w2, b2, dropout_mask, dropout_p)
    dropout_p = float(dropout_p) if dropout_mask is not None else 0.0
    weights = (w1, b1, w2) + ((b2,) if b2 is not None else ())
    if uses_kernels(coords) and all(uses_kernels(t) for t in weights) and not coords.requires_grad:
        inputs = (coords, w1, b1, w2, b2, dropout_mask, dropout_p, heads_first)
        # the weights are checked too: tensor subclasses (a DTensor weight) take the operator
        if not (dispatch_free(coords) and all(type(t) in PLAIN_TENSOR_TYPES for t in weights)):
            return call_operator(position_mlp_table_op, *inputs)
        if torch.is_grad_enabled() and any(t.requires_grad for t in weights):
            return _PositionMLP.apply(*inputs)
        with direct_launches():
            return _launch_table(*inputs)
    hidden = F.relu(F.linear(coords, w1, b1))
    if dropout_mask is not None:
        hidden = hidden * (dropout_mask != 0) * (1.0 / (1.0 - dropout_p))
    table = F.linear(hidden, w2, b2)
    return table.t() if heads_first else table


def fusable_cpb_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is timm's SwinV2 ``cpb_mlp`` as ``position_mlp_table`` computes it:
    nn.Sequential(nn.Linear(2, K), nn.ReLU(), nn.Linear(K, H, bias=False)) exactly, with no
    hooks on it, its layers or all modules (the kernel would skip them). Anything else
    keeps PyTorch's layers."""
    if type(mlp) is not nn.Sequential or len(mlp) != 3:
        return False
    fc1, act, fc2 = mlp
    return (type(fc1) is nn.Linear and type(act) is nn.ReLU and type(fc2) is nn.Linear and fc1.in_features == 2
            and fc1.bias is not None and fc2.bias is None
            and not runs_hooks(mlp, fc1, act, fc2))


def fusable_meta_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is SwinV2-CR's ``meta_mlp`` as ``position_mlp_table`` computes it:
    timm's Mlp with nn.Linear(2, K) (with a bias), nn.ReLU, an nn.Dropout (not in place),
    no norm (nn.Identity), nn.Linear(K, H) and an nn.Dropout of p = 0 (timm's: 0.125 and 0),
    with no hooks on it, its layers or all modules. Anything else keeps timm's layers."""
    from timm.layers import Mlp
    if type(mlp) is not Mlp:
        return False
    layers = (mlp.fc1, mlp.act, mlp.drop1, mlp.norm, mlp.fc2, mlp.drop2)
    types = (nn.Linear, nn.ReLU, nn.Dropout, nn.Identity, nn.Linear, nn.Dropout)
    return (all(type(layer) is kind for layer, kind in zip(layers, types)) and mlp.fc1.in_features == 2
            and mlp.fc1.bias is not None and not mlp.drop1.inplace and mlp.drop2.p == 0
            and not runs_hooks(mlp, *layers))


#: tensors of ones, the input of ``meta_mlp_dropout_mask``'s dropout, per (shape, dtype, device)
_ONES: Dict[Tuple, torch.Tensor] = {}


def meta_mlp_dropout_mask(mlp: nn.Module, coords: torch.Tensor) -> Optional[torch.Tensor]:
    """The dropout mask of a ``fusable_meta_mlp`` module's hidden units for one call, (T, K),
    nonzero where kept, drawn as timm's layer draws it: ``F.dropout`` of a tensor of the hidden
    layer's shape and dtype (the autocast dtype under autocast, as timm's fc1 output), so
    that the random numbers drawn, and every draw after them, are timm's (the mask depends
    on the RNG state, the shape and the dtype only). None where the dropout does nothing
    (eval mode, p = 0)."""
    drop = mlp.drop1
    if not drop.training or drop.p == 0:
        return None
    device_type = coords.device.type
    autocast = device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
    # timm's fc1 output: the autocast dtype, else its weight's (F.linear takes coordinates of that dtype)
    dtype = torch.get_autocast_dtype(device_type) if autocast else mlp.fc1.weight.dtype
    shape = (coords.shape[0], mlp.fc1.out_features)
    # under torch.compile in the graph (inductor fuses the ones into the dropout); under a
    # dispatch mode made anew (FakeTensorMode's would be fake: kept, later calls would read them)
    if not no_dispatch_mode():
        return F.dropout(torch.ones(shape, dtype=dtype, device=coords.device), drop.p, training=True)
    key = (*shape, dtype, coords.device)
    ones = _ONES.get(key)
    if ones is None:
        with torch.inference_mode(False):  # kept for training calls too (as WindowGrid's maps)
            ones = _ONES[key] = torch.ones(shape, dtype=dtype, device=coords.device)
    return F.dropout(ones, drop.p, training=True)
