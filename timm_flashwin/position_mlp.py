"""SwinV2's continuous position bias table, ``cpb_mlp(relative_coords_table)``, in one kernel.

timm's SwinV2 modules compute their relative-position table with an MLP,
Linear(2, K) -> ReLU -> Linear(K, H, bias=False), on the (T, 2) log-spaced coordinates, in
every training step. ``position_mlp_table`` computes it with one kernel forward and one
backward (kernels/position_mlp.py) where PyTorch launches three and five, each with its
autograd node (eager training steps of the tiny models are bound by such host work,
benchmarks/RESULTS.md). In eager mode on plain tensors the kernels run through a
``torch.autograd.Function`` (no operator dispatch), elsewhere as registered operators
(torch.compile, dispatch modes, tensor subclasses); on tensors the kernels do not take
(plain CPU, float64) it is the PyTorch expression. The table is fp32 (timm's autocast runs
the MLP in bf16); the weight gradients are in the weights' dtypes. ``fusable_cpb_mlp`` says
which modules it computes exactly (the SwinV2 adapter keeps timm's layers for others).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .hooks import runs_hooks
from .kernels.launch import position_mlp_grads, position_mlp_table as _launch_table, split_position_mlp_grads
from .dispatch import PLAIN_TENSOR_TYPES, direct_launches, dispatch_free, register_op, uses_kernels


def _weight_grads(grad: torch.Tensor, coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                  grads_op):
    """(dw1, db1, dw2) in the weights' dtypes, ``grads_op`` computing their fp32 vector."""
    dw1, db1, dw2 = split_position_mlp_grads(grads_op(grad, coords, w1, b1, w2), w1.shape[0], w2.shape[0])
    return dw1.to(w1.dtype), db1.to(b1.dtype), dw2.to(w2.dtype)


class _PositionMLP(torch.autograd.Function):
    """The eager path: the operators' kernels without their dispatch."""

    @staticmethod
    def forward(ctx, coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(coords, w1, b1, w2)
        with direct_launches():
            return _launch_table(coords, w1, b1, w2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        with direct_launches():
            return (None, *_weight_grads(grad, *ctx.saved_tensors, position_mlp_grads))


# ----------------------------------------------------------------- registered operators
def _table_fake(coords, w1, b1, w2):
    return coords.new_empty((coords.shape[0], w2.shape[0]), dtype=torch.float32)


def _grads_fake(grad, coords, w1, b1, w2):
    return coords.new_empty(((3 + w2.shape[0]) * w1.shape[0],), dtype=torch.float32)


position_mlp_table_op = register_op("position_mlp_table", _launch_table, _table_fake)
position_mlp_grads_op = register_op("position_mlp_grads", position_mlp_grads, _grads_fake)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return (None, *_weight_grads(grad, *ctx.saved_tensors, position_mlp_grads_op))


position_mlp_table_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------- public functions
def position_mlp_table(coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``relu(coords @ w1^T + b1) @ w2^T``, (T, H) float32, from coords (T, 2), w1 (K, 2),
    b1 (K,) and w2 (H, K): SwinV2's ``cpb_mlp`` applied to its coordinates table. The
    weights get gradients (fp32 sums, returned in their dtypes); coordinates that require a
    gradient (timm's are a buffer), and tensors the kernels do not take (plain CPU tensors,
    float64), go through the PyTorch expression, in the inputs' dtype."""
    if coords.dim() != 2 or coords.shape[1] != 2 or coords.shape[0] < 1:
        raise ValueError(f"position_mlp_table: `coords` must be of shape (T, 2) with T >= 1, "
                         f"got {tuple(coords.shape)}")
    if (w1.dim() != 2 or b1.dim() != 1 or w2.dim() != 2 or w1.shape[1] != 2 or min(w1.shape[0], w2.shape[0]) < 1
            or b1.shape[0] != w1.shape[0] or w2.shape[1] != w1.shape[0]):
        raise ValueError(f"position_mlp_table: expected w1 (K, 2), b1 (K,), w2 (H, K) with K, H >= 1, got "
                         f"w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, w2 {tuple(w2.shape)}")
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2)):
        if t.device != coords.device:
            raise ValueError(f"position_mlp_table: `{name}` must be on coords' device {coords.device}, got {t.device}")
    if uses_kernels(coords) and all(uses_kernels(t) for t in (w1, b1, w2)) and not coords.requires_grad:
        # the weights are checked too: tensor subclasses (a DTensor weight) take the operator
        if not (dispatch_free(coords) and all(type(t) in PLAIN_TENSOR_TYPES for t in (w1, b1, w2))):
            return position_mlp_table_op(coords, w1, b1, w2)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (w1, b1, w2)):
            return _PositionMLP.apply(coords, w1, b1, w2)
        with direct_launches():
            return _launch_table(coords, w1, b1, w2)
    return F.linear(F.relu(F.linear(coords, w1, b1)), w2)


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
