"""``window_attention``: one call, top to bottom.

1. ``window_checks.checked_call``: each bad argument raises, naming it; a valid call becomes
   its description (``kernels.window.call.WindowCall``) and its tensors (``WindowTensors``),
   once. Every layer below reads them by name.
2. ``kernels.window.plan.call_plan``: the plan of the call on its device (made once per
   description): whether the kernels take it, read the position bias from its table, map the
   feature-map layout in the backward, what the forward saves.
3. The road: where the kernels do not take the tensors (plain CPU, float64) or the device,
   ``reference.py``'s math with PyTorch autograd; under torch.compile, fake tensors, tensor
   subclasses or torch.func, the registered operators (``window_operators``); in plain eager
   mode, the kernels launched here (``_EagerWindowAttention``, or ``_forward_without_grad``
   where nothing takes a gradient), on CUDA from a description's second call as a host program
   replayed by C++ (``host_program``), which makes the same launches.
4. ``kernels.window.launch``: the launches, as the forward's and backward's launch plans say.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..kernels.position.launch import relative_bias_gather, relative_bias_table_grad
from ..kernels.window.bias_mask import kept_mask_structure, kept_streamed_bias
from ..kernels.arch import tensor_arch
from ..kernels.window.call import (DENSE_BIAS, IMAGE_MAJOR_QUERY, OWN_QUERY, TABLE_BIAS, TILED_QUERY, WindowCall,
                                   WindowSaved, WindowTensors, settings)
from ..kernels.window.launch import attention_backward, attention_forward
from ..kernels.window.plan import CallPlan, backward_plan, call_plan, forward_plan
from . import host_program
from .dispatch import call_operator, direct_launches, dispatch_free, served, uses_kernels
from .dropout_seed import draw_dropout_seed
from .position_bias import WINDOW_NAMES, TableBias, TableRows, operator_table_rows
from .reference import shared_query_qkv, window_attention_reference
from .window_checks import bias_parts, keys_values_query, validate
from .window_grid import WindowGrid
from .window_operators import input_grads, operator_inputs, save, saved_of, window_attention_fwd

#: ``query_order`` -> where the kernels read a window's queries (``call.WindowCall.query``)
_QUERY_ORDERS = {"image_major": IMAGE_MAJOR_QUERY, "tiled": TILED_QUERY}


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
        scale: V1 score scale (a finite Python float; ValueError otherwise, as the local operators).
        logit_scale: tensor with H elements (cosine attention); gets a gradient, zero
            where the clamp at ln 100 is active, as torch.clamp gives. Its values are not
            checked (a host read per call): +inf / -inf / NaN give what timm's math does.
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
    # 1. the call, checked (window_checks) and described once; by name from here on
    windows, n, head_dim = validate(qkv, num_heads, bias, mask, scale, logit_scale, dropout_p, grid, query,
                                    query_order)
    if query is not None:
        qkv, query = keys_values_query(qkv, query, num_heads)
    kind, bias_read, index, sigmoid = bias_parts(bias)
    if logit_scale is not None:  # the kernels clamp it at ln 100 and exponentiate it (tiles.head_scale)
        logit_scale = logit_scale.reshape(num_heads).contiguous()  # read as logit_scale_ptr + h
    # the seed is drawn where the kernels run
    tensors = WindowTensors(qkv, query, bias_read, mask, logit_scale, None, index, None, None)
    # Where nothing takes a gradient (inference), the forward saves no softmax statistics:
    # for cosine attention over more than 64 tokens that also skips summing the rows' mean
    # score, 3 to 6% of that forward (H200, 2026-11-23).
    save_stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
        tensors.qkv, tensors.query, tensors.bias, tensors.logit_scale))
    call = WindowCall(windows, n, num_heads, head_dim, tensors.qkv.dtype, tensor_arch(tensors.qkv), kind, sigmoid,
                      mask.shape[0] if mask is not None else 0, logit_scale is not None,
                      float(scale) if scale is not None else 1.0, float(dropout_p), save_stats, grid,
                      _QUERY_ORDERS[query_order] if query is not None else OWN_QUERY, settings())
    # 2. its plan on its device: every question about the call is answered there
    plan = call_plan(call) if uses_kernels(tensors.qkv) else None
    kernels = plan is not None and served(call.arch, call.dtype, lambda: plan.misfit)
    # 3. the road: PyTorch's math, the registered operators, or the kernels launched here (eager)
    eager = kernels and dispatch_free(tensors.qkv) and (tensors.query is None or dispatch_free(tensors.query))
    if grid is not None and not (eager and plan.maps_windows(backward=call.save_stats)):
        partitioned = window_attention(grid.partition(qkv), num_heads, bias=bias, mask=mask, scale=scale,
                                       logit_scale=logit_scale, dropout_p=dropout_p)
        return grid.merge(partitioned)
    if call.bias == TABLE_BIAS:
        call, tensors = _table_road(call, tensors, bias, plan if kernels else None, eager)
    if not kernels:
        return _reference(call, tensors)
    # 4. launch
    if call.dropout:
        tensors = tensors._replace(seed=draw_dropout_seed(tensors.qkv.device))
    if not eager:
        return call_operator(window_attention_fwd, *operator_inputs(call, tensors))[0]
    return _eager_call(call, plan, tensors)


def _reference(call: WindowCall, tensors: WindowTensors) -> torch.Tensor:
    """PyTorch's road: timm's math (``reference.py``), with PyTorch's autograd."""
    qkv = tensors.qkv
    if tensors.query is not None:
        qkv = shared_query_qkv(qkv, tensors.query, call.query == TILED_QUERY)
    return window_attention_reference(qkv, call.heads, bias=tensors.bias, mask=tensors.mask,
                                      scale=None if call.cosine else call.scale, logit_scale=tensors.logit_scale,
                                      dropout_p=call.dropout_p)


def _table_road(call: WindowCall, tensors: WindowTensors, bias: TableBias, plan: Optional[CallPlan], eager: bool
                ) -> Tuple[WindowCall, WindowTensors]:
    """A ``TableBias`` as its road takes it: in eager mode, read from its table by the kernels
    (``plan.reads_table``) or gathered, and its table's gradient summed, in the eager road's
    own node, from its rows (``TableRows``: the int32 index, the pairs by table row); by the
    registered operators, read from its table too where the kernels can (no gather launched,
    no dense bias kept), the index as it is now, its pairs sorted when traced; else gathered
    here (``TableBias.dense``)."""
    if eager and dispatch_free(tensors.bias):
        rows = TableRows.of(tensors.index, tensors.bias.shape[0], WINDOW_NAMES)
        return call, tensors._replace(index=rows.index32, order=rows.order, offsets=rows.offsets)
    if plan is not None and plan.reads_table and not eager:
        grad = torch.is_grad_enabled() and tensors.bias.requires_grad
        order, offsets = operator_table_rows(tensors.index, tensors.bias, bias.constant_index) if grad else (None, None)
        return call, tensors._replace(index=tensors.index.contiguous(), order=order, offsets=offsets)
    return call._replace(bias=DENSE_BIAS, sigmoid=0.0), tensors._replace(bias=bias.dense(), index=None)


# --------------------------------------------------------------------------- the eager road
class _EagerWindowAttention(torch.autograd.Function):
    """The operator's forward and backward without the operator dispatch around them.

    In eager mode the dispatch of a ``triton_op`` (custom-op dispatch, its autograd
    wrapper, the redispatch and dynamo's disable guard, once per pass) costs host time,
    and eager training steps of the tiny models are bound by host time
    (benchmarks/RESULTS.md): kernels stubbed out, on a CPU, forward + backward 440 -> 236 us
    per call (2026-11-23). torch.compile, fake tensors and tensor subclasses still get the
    registered operators (``dispatch.dispatch_free``).

    Its inputs are the call's description, its plan and its tensors, which only these eager
    launches take in the feature-map layout (``window_attention(..., grid=)``); a
    ``TABLE_BIAS``'s tensors are its table and rows, the table read by the kernels through the
    index where windows are one tile (else gathered here, ``_as_read``), and its gradient
    summed here from the bias gradient: one autograd node, and in one-tile windows one kernel
    launch, fewer than a gather of its own.
    """

    @staticmethod
    def forward(ctx, call: WindowCall, plan: CallPlan, *tensors):
        tensors = WindowTensors._make(tensors)
        with direct_launches():
            read = _as_read(call, plan, tensors)
            outputs = attention_forward(call, forward_plan(call), read)
            # the backward reads the bias copy the forward kept on the bias (kernels that
            # stream key blocks): saved, its host program takes it from the forward's
            bias_copy = kept_streamed_bias(call, read.bias, read.mask) if host_program.noting_forward() else None
        # the table is kept for the derivative of its sigmoid, where the bias read is the gathered one
        table = tensors.bias if read.bias is not tensors.bias and call.sigmoid else None
        saved = WindowSaved(read.qkv, read.query, read.bias, read.mask, read.logit_scale, read.seed, *outputs, table,
                            bias_copy, read.index, read.order, read.offsets)
        to_save, kept = save(ctx, call, saved, rows_saved=False)
        host_program.note_forward(ctx, to_save, kept, outputs.out)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_stats, _grad_regions, _grad_mask_info):
        (saved, known), call = saved_of(ctx), ctx.call
        _call, _plan, *needed = ctx.needs_input_grad
        needs = WindowTensors._make(needed)
        bias_grad = saved.bias is not None and needs.bias
        scale_grad = saved.logit_scale is not None and needs.logit_scale
        with direct_launches(), host_program.backward_recording(ctx, (*known, grad_out)) as recorded:
            dqkv, dbias, dscale = attention_backward(call, backward_plan(call, bias_grad, scale_grad), saved, grad_out)
            if bias_grad and call.bias == TABLE_BIAS:  # the table's rows summed from the dense gradient
                table = saved.table if saved.table is not None else saved.bias
                dbias = relative_bias_table_grad(dbias, saved.order, saved.offsets, saved.offsets.shape[0] - 1,
                                                 saved.bias.dtype, table=table if call.sigmoid else None,
                                                 sigmoid_scale=call.sigmoid)
            grads = input_grads(call, saved, needs, dqkv, dbias if bias_grad else None, dscale if scale_grad else None)
            if recorded is not None:  # the gradients of the host program's inputs (``_eager_call``'s)
                recorded([grad for grad, tensor in zip(grads, _inputs_of(saved)) if tensor is not None])
        return (None, None, *grads)


def _inputs_of(saved: WindowSaved) -> WindowTensors:
    """The call's tensors among what its forward saved (as the kernels read them: a gathered
    table's dense bias in its place), for their gradients."""
    return WindowTensors(saved.qkv, saved.query, saved.bias, saved.mask, saved.logit_scale, saved.seed, saved.index,
                         saved.order, saved.offsets)


def _as_read(call: WindowCall, plan: CallPlan, tensors: WindowTensors) -> WindowTensors:
    """The tensors as the kernels read them: a ``TABLE_BIAS`` whose table they do not read
    (windows of more than one tile, ``plan.reads_table``) gathered into its dense bias, through
    the int32 index a host program takes as an input."""
    if call.bias != TABLE_BIAS or plan.reads_table:
        return tensors
    return tensors._replace(bias=relative_bias_gather(tensors.bias, tensors.index, call.sigmoid))


def _eager_call(call: WindowCall, plan: CallPlan, tensors: WindowTensors) -> torch.Tensor:
    """The eager forward: where a gradient follows (``save_stats``), ``_EagerWindowAttention``,
    else ``_forward_without_grad``; on CUDA either one's host program replayed
    (``host_program``: recorded on the first call of its key, the call's description and its
    tensors' layouts)."""
    if call.save_stats:
        python_road = lambda: _EagerWindowAttention.apply(call, plan, *tensors)[0]  # noqa: E731
    else:
        python_road = lambda: _forward_without_grad(call, plan, tensors)  # noqa: E731
    if not host_program.takes(tensors.qkv):
        return python_road()
    inputs = [t for t in tensors if t is not None]
    inputs += _kept_mask_regions(plan, tensors.mask)
    key = (call, tuple(map(host_program.tensor_key, inputs)))
    return host_program.call(key, inputs, python_road, grad=call.save_stats)


def _kept_mask_regions(plan: CallPlan, mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The mask's region ids and info (``kept_mask_structure``) where the kernels read them
    (``plan.regions_used``), kept on the mask: a host program takes them as inputs, as the
    Python road takes them from the mask, rather than computing them in every replay (a dozen
    small kernels, and a list ``torch.cat`` that stopped the recording) or failing to record a
    second signature of the same mask (values kept by an earlier call). Nothing for a mask
    made in inference mode, which keeps nothing."""
    if mask is None or mask.is_inference() or not plan.regions_used:
        return ()
    with direct_launches():
        return kept_mask_structure(mask)


def _forward_without_grad(call: WindowCall, plan: CallPlan, tensors: WindowTensors) -> torch.Tensor:
    """The forward where nothing takes a gradient (``save_stats`` False), launched directly,
    with no autograd node (a torch.autograd.Function's apply costs host time, which small
    eager inference calls are bound by)."""
    with direct_launches():
        return attention_forward(call, forward_plan(call), _as_read(call, plan, tensors)).out
