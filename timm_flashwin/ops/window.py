"""``window_attention``: one call, top to bottom.

1. ``window_checks.validate``: each bad argument raises, naming it.
2. ``kernels.window.plan.call_plan``: the plan of the call's shape on its device (made once
   per signature): whether the kernels take it, read the position bias from its table, map
   the feature-map layout in the backward, what the forward saves.
3. The road: where the kernels do not take the tensors (plain CPU, float64) or the device,
   ``reference.py``'s math with PyTorch autograd; under torch.compile, fake tensors, tensor
   subclasses or torch.func, the registered operators (``window_operators``); in plain eager
   mode, the kernels launched here (``_EagerWindowAttention``, or ``_forward_without_grad``
   where nothing takes a gradient), on CUDA from a signature's second call as a host program
   replayed by C++ (``host_program``), which makes the same launches.
4. ``kernels.window.launch``: the launches, as the forward's and backward's launch plans say.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Tuple, Union

import torch

from ..kernels.arch import tensor_arch
from ..kernels.window.bias_mask import kept_mask_structure, kept_streamed_bias
from ..kernels.window.launch import attention_backward, attention_forward
from ..kernels.window.plan import CallPlan, call_plan
from . import host_program
from .dropout_seed import draw_dropout_seed
from .dispatch import call_operator, direct_launches, dispatch_free, served, uses_kernels
from .position_bias import TableBias, TableGather
from .reference import shared_query_qkv, window_attention_reference
from .window_checks import keys_values_query, validate
from .window_grid import WindowGrid
from .window_operators import (backward_outputs, input_grads, operator_table_args, query_grads, setup_context,
                               window_attention_fwd)


def window_attention(
    qkv: torch.Tensor,
    num_heads: int,
    *,
    bias: Union[torch.Tensor, TableBias, None] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    logit_scale: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    grid: Optional[WindowGrid] = None,
    query: Optional[torch.Tensor] = None,
    query_order: str = "image_major",
) -> torch.Tensor:
    """Fused window attention from the qkv linear output to the proj input.

    ``O = dropout(softmax(S + bias[h] + mask[b % nW])) @ V`` per window b and head h, with
    ``S = scale * Q K^T`` (Swin V1) or, when ``logit_scale`` is given,
    ``S = exp(min(logit_scale[h], ln 100)) * Q^ K^^T`` with L2-normalized rows (SwinV2).

    Args:
        qkv: (B_, N, 3*H*D) float16/bfloat16/float32 (float64 runs in PyTorch), laid out as
            timm's qkv linear produces it (q, k, v, each H heads of D channels); any strides.
            Or (B_, N, 3, H, D), any strides: other layouts as views, read in place, e.g. a
            head-interleaved qkv (MaxViT's, channels (H, 3, D)) as
            ``qkv.unflatten(-1, (H, 3, D)).transpose(2, 3)``; a channels-first qkv (B_, 3*H*D, N),
            a 1x1 convolution's, is ``qkv.transpose(1, 2)``, 3-D. Its gradient comes in qkv's
            layout where qkv is dense (``torch.empty_like``).
        num_heads: H. The head dim D can be anything in [1, 256] (multiples of 8 are
            fastest: rows are then 16-byte aligned); N in [1, 1024].
        bias: (H, N, N) or (1, H, N, N), qkv's dtype or float32; gets a gradient. Or a
            ``TableBias`` (a table (T, H) of qkv's dtype or float32 and an (N, N) index into
            it, timm's relative-position bias): the same values, and the table gets the
            gradient; the kernels of windows up to 64 tokens read the table themselves
            (eager or compiled), in eager mode within the op's one autograd node.
        mask: (nW, N, N) additive float mask (timm's 0/-100, -inf works); B_ % nW == 0.
            Takes no gradient.
        scale: V1 score scale (a Python float).
        logit_scale: tensor with H elements (cosine attention); gets a gradient, zero
            where the clamp at ln 100 is active, as torch.clamp gives.
        dropout_p: attention dropout on the probabilities, in [0, 1), scaled by
            1 / (1 - p) as nn.Dropout does. Applied whenever > 0: pass 0 in eval mode, as
            with F.scaled_dot_product_attention. The kernels draw the mask from a seed taken
            from torch's generator (``draw_dropout_seed``) and regenerate it in the backward.
        grid: the feature-map layout: qkv is (B, H*W, 3*H*D), the qkv linear's output on the
            unpartitioned (B, H, W, C) map, and the windows are ``grid``'s (its shift and
            partition, as timm's blocks make them; window b = image * nW + w, as in
            ``grid.partition``). The kernels read each window's rows where they lie and write
            the output there: ``grid.merge(window_attention(grid.partition(qkv), ...))``
            without the copies. Where the kernels cannot (torch.compile, tensor subclasses,
            windows whose backward streams key blocks, PyTorch's path), it is computed so.
        query: (B, N, H*D), queries that the windows of an image share (GCViT's global
            query), qkv's dtype; qkv is then (B_, N, 2*H*D), keys and values, B_ a multiple
            of B. The kernels read each window's queries from here, and the query's gradient
            is summed over its image's windows. No ``grid``.
        query_order: which image's queries window b takes: ``"image_major"`` b // (B_ / B),
            an image's windows in a row (``query.repeat_interleave(B_ // B, 0)``, timm 1.0.31's
            GCViT), or ``"tiled"`` b % B (``query.repeat(B_ // B, 1, 1)``, earlier timm's).

    Returns:
        (B_, N, H*D) in qkv's dtype; with ``grid``, (B, H*W, H*D).
    """
    # 1. validate: each bad argument named (window_checks)
    _, n, head_dim = validate(qkv, num_heads, bias, mask, scale, logit_scale, dropout_p, grid, query, query_order)
    query_tiled = query_order == "tiled"
    if query is not None:
        qkv, query = keys_values_query(qkv, query, num_heads)
    table_bias = isinstance(bias, TableBias)
    # Where nothing takes a gradient (inference), the forward saves no softmax statistics:
    # for cosine attention over more than 64 tokens that also skips summing the rows' mean
    # score, 3 to 6% of that forward (H200, 2026-11-23).
    save_stats = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (qkv, bias.table if table_bias else bias, logit_scale, query))
    # 2. the plan of this shape on this device: every question about the call is answered there
    arch = tensor_arch(qkv)
    plan = call_plan(n, head_dim, qkv.dtype, logit_scale is not None, dropout_p > 0, arch) if uses_kernels(qkv) else None
    kernels = plan is not None and served(arch, qkv.dtype, lambda: plan.misfit)
    # 3. the road: PyTorch's math, the registered operators, or the kernels launched here (eager)
    eager = kernels and dispatch_free(qkv) and (query is None or dispatch_free(query))
    if grid is not None and not (eager and plan.maps_windows(backward=save_stats)):
        windows = window_attention(grid.partition(qkv), num_heads, bias=bias, mask=mask, scale=scale,
                                   logit_scale=logit_scale, dropout_p=dropout_p)
        return grid.merge(windows)
    table_gather, operator_table = None, ()
    in_kernels = table_bias and kernels and plan.reads_table
    if table_bias and eager and dispatch_free(bias.table):
        # read from its table by the kernels, or gathered, and its table's gradient summed, in the
        # eager path's own node
        table_gather, bias = TableGather.of(bias, in_kernels), bias.table
    elif in_kernels and not eager:
        # the registered operators read the table too (no gather launched, no dense bias kept)
        # and sum its gradient; the index as it is now, its pairs sorted when traced
        operator_table = operator_table_args(bias, torch.is_grad_enabled() and bias.table.requires_grad)
        bias = bias.table
    elif table_bias:
        bias = bias.dense()
    if not kernels:
        if query is not None:
            qkv = shared_query_qkv(qkv, query, query_tiled)
        return window_attention_reference(qkv, num_heads, bias=bias, mask=mask, scale=scale, logit_scale=logit_scale,
                                          dropout_p=dropout_p)
    # 4. launch, with the inputs as the kernels read them
    if table_gather is None and bias is not None and bias.dim() == 4:
        bias = bias[0]
    if logit_scale is not None:  # the kernels clamp it at ln 100 and exponentiate it (tiles.head_scale)
        logit_scale = logit_scale.reshape(num_heads).contiguous()  # read as logit_scale_ptr + h
    dropout_p = float(dropout_p)
    seed = draw_dropout_seed(qkv.device) if dropout_p > 0 else None
    inputs = (qkv, num_heads, bias, mask, logit_scale, float(scale) if scale is not None else 1.0,
              logit_scale is not None, dropout_p, seed, save_stats)
    if not eager:
        if query is not None:  # the arguments past the table's
            operator_table = (*(operator_table or (None, None, None, 0.0)), query, query_tiled)
        return call_operator(window_attention_fwd, *inputs, *operator_table)[0]
    return _eager_call(inputs, plan, grid, table_gather, query, query_tiled)


# --------------------------------------------------------------------------- the eager road
class _EagerWindowAttention(torch.autograd.Function):
    """The operator's forward and backward without the operator dispatch around them.

    In eager mode the dispatch of a ``triton_op`` (custom-op dispatch, its autograd
    wrapper, the redispatch and dynamo's disable guard, once per pass) costs host time,
    and eager training steps of the tiny models are bound by host time
    (benchmarks/RESULTS.md). bench_dispatch.py (removed at fc2fe00, in git), kernels stubbed out, on a CPU:
    forward + backward 440 -> 236 us per call. torch.compile, fake tensors and tensor
    subclasses still get the registered operators (``dispatch.dispatch_free``).

    Its inputs are the operator's, the ``WindowGrid`` of the feature-map layout (None for
    the partitioned one), which only these eager launches take (``window_attention(...,
    grid=)``), and a ``TableGather`` where the bias is a ``TableBias``: the bias input is
    then its table, which the kernels read through the index where windows are one tile
    (else it is gathered here), and the table's gradient is summed here from the bias
    gradient: one autograd node, and in one-tile windows one kernel launch, fewer than a
    gather of its own.
    """

    @staticmethod
    def forward(ctx, *inputs):
        *inputs, grid, table_gather, query, query_tiled = inputs
        table = inputs[2] if table_gather is not None else None
        table_args = table_gather.kernel_args() if table is not None else ()
        # the table is kept for the derivative of its sigmoid, where the bias saved is the gathered one
        also_saved = (table,) if table is not None and not table_args and table_gather.sigmoid_scale else ()
        with direct_launches():
            if table is not None and not table_args:  # the kernels read the gathered bias
                inputs[2] = table_gather.gather(table)
            output = attention_forward(*inputs, grid, *table_args, query=query, query_tiled=query_tiled)
            if host_program.noting_forward():
                # the backward reads the bias copy the forward kept on the bias (kernels that
                # stream key blocks): saved, its host program takes it from the forward's
                bias_copy = kept_streamed_bias(inputs[2], inputs[3], inputs[0].dtype, inputs[1])
                also_saved += (bias_copy,) if bias_copy is not None else ()
        setup_context(ctx, inputs, output, query, query_tiled, *also_saved)
        ctx.grid, ctx.table_gather, ctx.table_args = grid, table_gather, table_args
        ctx.table_dtype = table.dtype if table is not None else None
        host_program.note_forward(ctx, ctx.to_save, _host_tensors(table_gather), output[0])
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_stats, _grad_regions, _grad_mask_info):
        table_gather, saved = ctx.table_gather, ctx.saved_tensors
        host_tensors = _host_tensors(table_gather)
        with direct_launches(), host_program.backward_recording(ctx, (*saved, *host_tensors, grad_out)) as recorded:
            query = saved[9]
            backward = partial(attention_backward, query=query, query_tiled=ctx.query_tiled)
            dqkv, dbias, dscale = backward_outputs(backward, ctx, saved, grad_out, ctx.grid, *ctx.table_args)
            dqkv, dquery = query_grads(dqkv, query, ctx.query_tiled, ctx.needs_input_grad[12])
            if dbias is not None and table_gather is None:
                dbias = dbias.to(saved[5].dtype)
            elif dbias is not None:
                table = None if not table_gather.sigmoid_scale else saved[5] if ctx.table_args else saved[10]
                dbias = table_gather.table_grad(dbias, ctx.table_dtype, table)
            if recorded is not None:  # the gradients of the host program's inputs (``_eager_call``'s order)
                recorded((dqkv, *(g for g, t in zip((dbias, None, dscale, None, dquery), saved[5:10])
                                  if t is not None)))
        return input_grads(ctx, dqkv, dbias, dscale, extra_inputs=2) + (dquery, None)


def _host_tensors(table_gather: Optional[TableGather]) -> Tuple[torch.Tensor, ...]:
    """The tensors of a ``TableGather`` that its launches read, which a host program takes as
    inputs: the int32 index (read by the attention kernels or by the gather), the pairs'
    order and offsets."""
    if table_gather is None:
        return ()
    rows = table_gather.rows
    return rows.index32, rows.order, rows.offsets


def _eager_call(inputs: tuple, plan: CallPlan, grid: Optional[WindowGrid], table_gather: Optional[TableGather],
                query: Optional[torch.Tensor], query_tiled: bool) -> torch.Tensor:
    """The eager forward: where a gradient follows (``save_stats``), ``_EagerWindowAttention``,
    else ``_forward_without_grad``; on CUDA either one's host program replayed
    (``host_program``: recorded on the signature's first call)."""
    qkv, num_heads, bias, mask, logit_scale, scale, cosine, dropout_p, seed, save_stats = inputs
    layout = (grid, table_gather, query, query_tiled)
    if save_stats:
        python_road = lambda: _EagerWindowAttention.apply(*inputs, *layout)[0]  # noqa: E731
    else:
        python_road = lambda: _forward_without_grad(*inputs, *layout)[0]  # noqa: E731
    if not host_program.takes(qkv):
        return python_road()
    tensors = (qkv, bias, mask, logit_scale, seed, query)
    extra = _host_tensors(table_gather) + _kept_mask_regions(plan, num_heads, mask)
    key_of = host_program.tensor_key
    key = (tuple(map(key_of, tensors)), tuple(map(key_of, extra)), num_heads, scale, cosine, dropout_p, grid,
           table_gather.key() if table_gather is not None else None, query_tiled, host_program.settings_key())
    return host_program.call(key, [t for t in tensors if t is not None] + list(extra), python_road, grad=save_stats)


def _kept_mask_regions(plan: CallPlan, num_heads: int, mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The mask's region ids and info (``kept_mask_structure``) where the kernels read them
    (``plan.regions_used``), kept on the mask: a host program takes them as inputs, as the
    Python road takes them from the mask, rather than computing them in every replay (a dozen
    small kernels, and a list ``torch.cat`` that stopped the recording) or failing to record a
    second signature of the same mask (values kept by an earlier call). Nothing for a mask
    made in inference mode, which keeps nothing."""
    if mask is None or mask.is_inference() or not plan.regions_used(mask, num_heads):
        return ()
    with direct_launches():
        return kept_mask_structure(mask)


def _forward_without_grad(*inputs):
    """The forward where nothing takes a gradient (``save_stats`` False), launched directly,
    with no autograd node (a torch.autograd.Function's apply costs host time, which small
    eager inference calls are bound by); the inputs are ``_EagerWindowAttention``'s."""
    *inputs, grid, table_gather, query, query_tiled = inputs
    table_args = table_gather.kernel_args() if table_gather is not None else ()
    with direct_launches():
        if table_gather is not None and not table_args:
            inputs[2] = table_gather.gather(inputs[2])
        return attention_forward(*inputs, grid, *table_args, query=query, query_tiled=query_tiled)


