"""The window-attention operators registered with torch.library, their autograd, and the one
place where a call's description and tensors (``kernels.window.call``) become the operators'
flat schemas and back.

``timm_flashwin::window_attention_fwd`` runs the forward kernels and returns the output,
the softmax statistics and the mask's region ids; its autograd formula calls
``timm_flashwin::window_attention_bwd``. torch.compile, fake tensors, tensor subclasses
and torch.func's transforms reach the kernels through them (``window.window_attention``
chooses; ``dispatch`` says when). The eager road (``window._EagerWindowAttention``) shares
the autograd helpers below: what the forward saves (``save``, ``saved_of``) and the gradients
of the inputs (``input_grads``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.arch import tensor_arch
from ..kernels.position.launch import relative_bias_table_grad
from ..kernels.window.bias_mask import mask_regions_shapes
from ..kernels.window.call import (DENSE_BIAS, IMAGE_MAJOR_QUERY, NO_BIAS, OWN_QUERY, TABLE_BIAS, TILED_QUERY,
                                   WindowCall, WindowSaved, WindowTensors, settings)
from ..kernels.window.launch import attention_backward, attention_forward
from ..kernels.window.layout import windows_tokens_channels
from ..kernels.window.plan import backward_plan, call_plan, forward_plan
from .dispatch import call_operator, register_autograd, register_op


# ----------------------------------------------------------------- the flat schemas
def _call_of(qkv, num_heads, bias, mask, cosine, scale, dropout_p, save_stats, table_index, table_sigmoid, query,
             query_tiled) -> WindowCall:
    """The description of an operator call (``_forward_impl``'s arguments)."""
    windows, n, channels = windows_tokens_channels(qkv, None)
    kind = TABLE_BIAS if table_index is not None else DENSE_BIAS if bias is not None else NO_BIAS
    query_mode = OWN_QUERY if query is None else TILED_QUERY if query_tiled else IMAGE_MAJOR_QUERY
    return WindowCall(windows, n, num_heads, channels // (3 * num_heads), qkv.dtype, tensor_arch(qkv), kind,
                      table_sigmoid, mask.shape[0] if mask is not None else 0, cosine, scale, dropout_p, save_stats,
                      None, query_mode, settings())


def operator_inputs(call: WindowCall, tensors: WindowTensors) -> tuple:
    """``window_attention_fwd``'s sixteen arguments for a call (partitioned windows: the
    operators take no ``grid``)."""
    return (tensors.qkv, call.heads, tensors.bias, tensors.mask, tensors.logit_scale, call.scale, call.cosine,
            call.dropout_p, tensors.seed, call.save_stats, tensors.index, tensors.order, tensors.offsets,
            call.sigmoid, tensors.query, call.query == TILED_QUERY)


def _needs(ctx) -> WindowTensors:
    """Which tensors of an operator call take a gradient, by name. ``needs_input_grad`` is as
    long as the call's arguments (a call may leave the last ones to their defaults)."""
    needs = (*ctx.needs_input_grad, *(False,) * (16 - len(ctx.needs_input_grad)))
    qkv, _, bias, mask, logit_scale, _, _, _, seed, _, index, order, offsets, _, query, _ = needs
    return WindowTensors(qkv, query, bias, mask, logit_scale, seed, index, order, offsets)


def _schema_grads(grads: WindowTensors) -> tuple:
    """``input_grads`` in the order of ``window_attention_fwd``'s sixteen arguments."""
    return (grads.qkv, None, grads.bias, None, grads.logit_scale, None, None, None, None, None, None, None, None, None,
            grads.query, None)


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
    (B_, N, 2, H, D), keys and values, and the windows share their image's queries."""
    call = _call_of(qkv, num_heads, bias, mask, cosine, scale, dropout_p, save_stats, table_index, table_sigmoid,
                    query, query_tiled)
    tensors = WindowTensors(qkv, query, bias, mask, logit_scale, seed, table_index, table_order, table_offsets)
    return tuple(attention_forward(call, forward_plan(call), tensors))


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
    call = _call_of(qkv, num_heads, bias, mask, cosine, scale, dropout_p, True, table_index, table_sigmoid, query,
                    query_tiled)
    saved = WindowSaved(qkv, query, bias, mask, logit_scale, seed, out, stats, regions, mask_info, None, None,
                        table_index, table_order, table_offsets)
    dqkv, dbias, dscale = attention_backward(call, backward_plan(call, bias_grad, scale_grad), saved, grad_out)
    if table_index is not None and bias_grad:
        dbias = relative_bias_table_grad(dbias, table_order, table_offsets, bias.shape[0], bias.dtype,
                                         index=table_index, table=bias if table_sigmoid else None,
                                         sigmoid_scale=table_sigmoid)
    # the two are views of one sum (launch.attention_backward); an operator's outputs may not alias
    return dqkv, dbias, dscale.clone() if bias_grad and scale_grad else dscale


def _forward_fake(qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed, save_stats=True,
                  table_index=None, table_order=None, table_offsets=None, table_sigmoid=0.0, query=None,
                  query_tiled=False):
    call = _call_of(qkv, num_heads, bias, mask, cosine, scale, dropout_p, save_stats, table_index, table_sigmoid,
                    query, query_tiled)
    plan = call_plan(call)
    out = qkv.new_empty((call.windows, call.tokens, num_heads * call.head_dim))
    regions_shape, info_shape = mask_regions_shapes(call.periods or 1, call.tokens, plan.regions_used)
    return (out, qkv.new_empty(plan.stats_shape(call), dtype=torch.float32),
            qkv.new_empty(regions_shape, dtype=torch.int32), qkv.new_empty(info_shape, dtype=torch.float32))


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


# ----------------------------------------------------------------- autograd, both roads
def save(ctx, call: WindowCall, saved: WindowSaved, rows_saved: bool) -> Tuple[tuple, tuple]:
    """Saves ``saved`` on ``ctx`` for the backward (``saved_of``) and marks the forward's
    statistics outputs non-differentiable; ``rows_saved``: the table's rows are saved too (the
    operators), else kept as attributes (the eager road: an index may be an inference tensor,
    which autograd cannot save). Returns (the tensors saved, the rows kept), what a host program
    holds of the forward (``host_program.note_forward``)."""
    ctx.mark_non_differentiable(saved.stats, saved.regions, saved.mask_info)
    # the backward takes no gradients of those three: not materialized, autograd launches
    # no fill kernels of zeros for them (launch.attention_backward has the measurement)
    ctx.set_materialize_grads(False)
    *autograd_saved, index, order, offsets = saved
    ctx.call, ctx.rows = call, () if rows_saved else (index, order, offsets)
    to_save = tuple(saved) if rows_saved else tuple(autograd_saved)
    ctx.save_for_backward(*to_save)
    return to_save, _present(ctx.rows)


def _present(rows: tuple) -> tuple:
    """The table's rows where the call has them (all three or none)."""
    return rows if any(t is not None for t in rows) else ()


def saved_of(ctx) -> Tuple[WindowSaved, tuple]:
    """(what ``save`` saved, by name; the same as a host program's backward recording knows
    them: the tensors saved, then the rows kept). ``ctx.saved_tensors`` is read once:
    activation checkpointing unpacks each saved tensor once."""
    unpacked = ctx.saved_tensors
    return WindowSaved(*unpacked, *ctx.rows), (*unpacked, *_present(ctx.rows))


def input_grads(call: WindowCall, saved: WindowSaved, needs: WindowTensors, dqkv: torch.Tensor,
                dbias: Optional[torch.Tensor], dscale: Optional[torch.Tensor]) -> WindowTensors:
    """The gradients of the call's tensors, by name (None where none), from the backward's
    dqkv, dbias (fp32, or the table's in its dtype) and d(logit_scale) (fp32), each None
    where not asked for."""
    dqkv, dquery = query_grads(dqkv, saved.query, call.query == TILED_QUERY, needs.query)
    return WindowTensors(dqkv, dquery, dbias.to(saved.bias.dtype) if dbias is not None else None, None,
                         dscale.to(saved.logit_scale.dtype) if dscale is not None else None, None, None, None, None)


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


def _setup_context(ctx, inputs, output):
    """The registered operator's (``inputs``: all sixteen, defaults filled in)."""
    (qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed, save_stats, table_index, table_order,
     table_offsets, table_sigmoid, query, query_tiled) = inputs
    call = _call_of(qkv, num_heads, bias, mask, cosine, scale, dropout_p, save_stats, table_index, table_sigmoid,
                    query, query_tiled)
    save(ctx, call, WindowSaved(qkv, query, bias, mask, logit_scale, seed, *output, None, None, table_index,
                                table_order, table_offsets), rows_saved=True)


def _backward(ctx, grad_out, _grad_stats, _grad_regions, _grad_mask_info):
    (saved, _), call, needs = saved_of(ctx), ctx.call, _needs(ctx)
    bias_grad = saved.bias is not None and needs.bias
    scale_grad = saved.logit_scale is not None and needs.logit_scale
    dqkv, dbias, dscale = call_operator(
        window_attention_bwd, grad_out, saved.qkv, saved.out, saved.stats, saved.regions, saved.mask_info, saved.bias,
        saved.mask, saved.logit_scale, call.heads, call.scale, call.cosine, bias_grad, scale_grad, call.dropout_p,
        saved.seed, saved.index, saved.order, saved.offsets, call.sigmoid, saved.query, call.query == TILED_QUERY)
    return _schema_grads(input_grads(call, saved, needs, dqkv, dbias if bias_grad else None,
                                     dscale if scale_grad else None))


register_autograd(window_attention_fwd, _backward, _setup_context)
