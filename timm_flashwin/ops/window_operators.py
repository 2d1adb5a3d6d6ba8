"""The window-attention operators registered with torch.library, and their autograd.

``timm_flashwin::window_attention_fwd`` runs the forward kernels and returns the output,
the softmax statistics and the mask's region ids; its autograd formula calls
``timm_flashwin::window_attention_bwd``. torch.compile, fake tensors, tensor subclasses
and torch.func's transforms reach the kernels through them (``window.window_attention``
chooses; ``dispatch`` says when). The eager road (``window._EagerWindowAttention``) shares
the autograd helpers below: the saved tensors, the backward's outputs, the gradients of the
inputs.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch

from ..kernels.arch import tensor_arch
from ..kernels.position.launch import relative_bias_table_grad
from ..kernels.window.bias_mask import mask_regions_shapes
from ..kernels.window.launch import attention_backward, attention_forward
from ..kernels.window.layout import windows_tokens_channels
from ..kernels.window.plan import call_plan
from .dispatch import call_operator, register_autograd, register_op
from .position_bias import TableBias, operator_table_rows


def _forward_impl(
    qkv: torch.Tensor,
    num_heads: int,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor],
    scale: float,
    cosine: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    save_stats: bool = True,
    table_index: Optional[torch.Tensor] = None,
    table_order: Optional[torch.Tensor] = None,
    table_offsets: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
    query: Optional[torch.Tensor] = None,
    query_tiled: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """With ``table_index`` (N, N), ``bias`` is a position-bias table (T, H) that the kernels
    read through it (``TableBias``, windows of one tile: ``plan.reads_table``); the pairs'
    ``table_order`` and ``table_offsets`` (``position_bias.operator_table_rows``) are for the
    backward, which sums the table's gradient. With ``query`` (B, N, H*D), qkv is
    (B_, N, 2, H, D), keys and values, and the windows share their image's queries
    (``launch.attention_forward``)."""
    return attention_forward(qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed, save_stats,
                             None, table_index, table_sigmoid, query, query_tiled)


def _backward_impl(
    grad_out: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    regions: torch.Tensor,
    mask_info: torch.Tensor,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor],
    num_heads: int,
    scale: float,
    cosine: bool,
    bias_grad: bool,
    scale_grad: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    table_index: Optional[torch.Tensor] = None,
    table_order: Optional[torch.Tensor] = None,
    table_offsets: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
    query: Optional[torch.Tensor] = None,
    query_tiled: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dbias is the table's gradient (T, H) in its dtype where ``bias`` is a table
    (``table_index``), else the dense bias's (H, N, N) in float32. With ``query``, dqkv is
    (B_, N, 3, H, D): each window's dQ beside dK and dV (``query_grads`` sums the former)."""
    dqkv, dbias, dscale = attention_backward(grad_out, qkv, out, stats, regions, mask_info, bias, mask, logit_scale,
                                             num_heads, scale, cosine, bias_grad, scale_grad, dropout_p, seed,
                                             None, table_index, table_sigmoid, query, query_tiled)
    if table_index is not None and bias_grad:
        dbias = relative_bias_table_grad(dbias, table_order, table_offsets, bias.shape[0], bias.dtype,
                                         index=table_index, table=bias if table_sigmoid else None,
                                         sigmoid_scale=table_sigmoid)
    # the two are views of one sum (launch.attention_backward); an operator's outputs may not alias
    return dqkv, dbias, dscale.clone() if bias_grad and scale_grad else dscale


def _forward_fake(qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed, save_stats=True,
                  table_index=None, table_order=None, table_offsets=None, table_sigmoid=0.0, query=None,
                  query_tiled=False):
    num_windows, n, channels = windows_tokens_channels(qkv, None)
    out = qkv.new_empty((num_windows, n, channels // 3))
    plan = call_plan(n, channels // (3 * num_heads), qkv.dtype, cosine, dropout_p > 0, tensor_arch(qkv))
    stats_shape = plan.stats_shape(num_windows, num_heads, save_stats)
    regions_shape, info_shape = mask_regions_shapes(mask.shape[0] if mask is not None else 1, n,
                                                    plan.regions_used(mask, num_heads))
    return (out, qkv.new_empty(stats_shape, dtype=torch.float32), qkv.new_empty(regions_shape, dtype=torch.int32),
            qkv.new_empty(info_shape, dtype=torch.float32))


def _backward_fake(grad_out, qkv, out, stats, regions, mask_info, bias, mask, logit_scale, num_heads, scale, cosine,
                   bias_grad, scale_grad, dropout_p, seed, table_index=None, table_order=None, table_offsets=None,
                   table_sigmoid=0.0, query=None, query_tiled=False):
    n = qkv.shape[1]
    if table_index is not None and bias_grad:
        dbias = torch.empty_like(bias, memory_format=torch.contiguous_format)
    else:
        dbias = qkv.new_empty((num_heads, n, n) if bias_grad else (0,), dtype=torch.float32)
    dscale = qkv.new_empty((num_heads,) if scale_grad and cosine else (0,), dtype=torch.float32)
    # the layout attention_backward gives
    dqkv = torch.empty_like(qkv) if query is None else qkv.new_empty((*qkv.shape[:2], 3, *qkv.shape[3:]))
    return dqkv, dbias, dscale


window_attention_fwd = register_op("window_attention_fwd", _forward_impl, _forward_fake)
window_attention_bwd = register_op("window_attention_bwd", _backward_impl, _backward_fake)


def setup_context(ctx, inputs, output, query, query_tiled, *also_saved):
    """Saves (qkv, out, stats, regions, mask_info, bias, mask, logit_scale, seed, query,
    *also_saved) and the call's numbers on ``ctx``."""
    qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed = inputs[:9]
    out, stats, regions, mask_info = output
    ctx.mark_non_differentiable(stats, regions, mask_info)
    # the backward takes no gradients of those three: not materialized, autograd launches
    # no fill kernels of zeros for them (launch.attention_backward has the measurement)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(qkv, out, stats, regions, mask_info, bias, mask, logit_scale, seed, query, *also_saved)
    ctx.num_heads, ctx.scale, ctx.cosine, ctx.dropout_p = num_heads, scale, cosine, dropout_p
    ctx.query_tiled = query_tiled


def _backward(ctx, grad_out, _grad_stats, _grad_regions, _grad_mask_info):
    saved = ctx.saved_tensors
    # the table's index and pairs (None where the bias is dense): _operator_setup_context
    backward_op = partial(call_operator, window_attention_bwd)
    dqkv, dbias, dscale = backward_outputs(backward_op, ctx, saved, grad_out, *saved[10:13], ctx.table_sigmoid,
                                            saved[9], ctx.query_tiled)
    # a call without a query passes fewer than its sixteen inputs: needs_input_grad is shorter
    dqkv, dquery = query_grads(dqkv, saved[9], ctx.query_tiled, saved[9] is not None and ctx.needs_input_grad[14])
    return input_grads(ctx, dqkv, dbias.to(saved[5].dtype) if dbias is not None else None, dscale,
                        extra_inputs=4) + (dquery, None)


def backward_outputs(backward_op, ctx, saved, grad_out, *layout):
    """(dqkv, dbias or None, d(logit_scale) in its dtype or None) with ``backward_op`` (the
    registered op, or its implementation in eager mode, which also takes the forward's
    ``WindowGrid``, in ``layout``); dbias fp32, as the op gives it.
    ``saved``: ``ctx.saved_tensors``, read once (activation checkpointing unpacks each
    saved tensor once)."""
    qkv, out, stats, regions, mask_info, bias, mask, logit_scale, seed = saved[:9]
    bias_grad = bias is not None and ctx.needs_input_grad[2]
    scale_grad = logit_scale is not None and ctx.needs_input_grad[4]
    dqkv, dbias, dscale = backward_op(
        grad_out, qkv, out, stats, regions, mask_info, bias, mask, logit_scale, ctx.num_heads, ctx.scale,
        ctx.cosine, bias_grad, scale_grad, ctx.dropout_p, seed, *layout)
    return dqkv, dbias if bias_grad else None, dscale.to(logit_scale.dtype) if scale_grad else None


def query_grads(dqkv: torch.Tensor, query: Optional[torch.Tensor], tiled: bool, query_grad: bool
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(qkv's gradient, the query's) from the backward's dqkv: as it is, None, without
    ``query``; else dqkv is (B_, N, 3, H, D) and qkv (B_, N, 2, H, D) gets dK, dV, and the
    query (B, N, H*D) each window's dQ summed over its image's windows (where ``query_grad``)."""
    if query is None:
        return dqkv, None
    if not query_grad:
        return dqkv[:, :, 1:], None
    windows, n = dqkv.shape[:2]
    images = query.shape[0]
    dq = dqkv[:, :, 0].reshape(windows, n, -1)
    dq = dq.view(windows // images, images, n, -1).sum(0) if tiled else dq.view(images, windows // images, n, -1).sum(1)
    return dqkv[:, :, 1:], dq


def input_grads(ctx, dqkv, dbias, dscale, extra_inputs: int = 0):
    """The gradients of the forward's inputs: the operator's ten and ``extra_inputs`` more
    that take none."""
    return (
        dqkv,
        None,
        dbias,
        None,  # the mask takes no gradient
        dscale,
        None,
        None,
        None,
        None,  # nor the dropout seed
        None,  # nor save_stats
    ) + (None,) * extra_inputs


def _operator_setup_context(ctx, inputs, output):
    """The registered operator's: also keeps its table's index and sorted pairs and the query
    (``_forward_impl``; ``inputs`` are all sixteen, defaults filled in)."""
    table_index, table_order, table_offsets, table_sigmoid, query, query_tiled = inputs[10:]
    setup_context(ctx, inputs, output, query, query_tiled, table_index, table_order, table_offsets)
    ctx.table_sigmoid = table_sigmoid


register_autograd(window_attention_fwd, _backward, _operator_setup_context)


def operator_table_args(bias: TableBias, grad: bool) -> tuple:
    """``window_attention_fwd``'s table arguments for a ``TableBias`` its kernels read: the
    index (contiguous, any integer dtype: the kernels load it as it is), the pairs sorted by
    table row where a gradient follows (``operator_table_rows``), the sigmoid scale."""
    index = bias.index
    order, offsets = operator_table_rows(index, bias.table, bias.constant_index) if grad else (None, None)
    scale = float(bias.sigmoid_scale) if bias.sigmoid_scale is not None else 0.0
    return index.contiguous(), order, offsets, scale
