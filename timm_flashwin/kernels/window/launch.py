"""Host side of the attention kernels: allocate the outputs, launch the forward's and the
backward's kernels for one call.

Each function takes the call's description (``call.WindowCall``), its plan (what to launch,
decided once per description: ``plan``) and its tensors by name (``WindowTensors``, or what
the forward saved, ``WindowSaved``); how the kernels read the bias and the mask (the float16
copy, the mask's region ids) is prepared by ``bias_mask``; how a launch goes out (traced or
direct) is ``launcher``'s. The tensors are validated (``timm_flashwin.ops.window_checks``);
torch operations and ``launcher`` launches only, so that ``torch.library.triton_op`` can
trace them under torch.compile.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .backward import window_attention_bwd_fused_kernel
from .backward_dkdv import window_attention_bwd_delta_kernel, window_attention_bwd_dkdv_kernel
from .backward_dq_dbias import (window_attention_bwd_dbias_kernel, window_attention_bwd_dq_finish_kernel,
                                window_attention_bwd_dq_kernel)
from .bias_mask import bias_mask_args, kept_mask_structure, mask_kinds_to_launch, streamed_bias
from .call import NO_BIAS, TABLE_BIAS, TILED_QUERY, ForwardOutputs, WindowCall, WindowSaved, WindowTensors
from .forward import window_attention_fwd_kernel
from ..launcher import launcher, traced_launch, unused_pointer
from .plan import BackwardPlan, ForwardPlan


def attention_forward(call: WindowCall, plan: ForwardPlan, tensors: WindowTensors) -> ForwardOutputs:
    """softmax(S + bias + mask) V per window and head, S = scale * Q K^T (V1) or, for cosine
    attention, exp(min(logit_scale, ln 100)) * Q^ K^^T (rows normalized), with the tensors as
    ``WindowTensors`` describes them (window b taking mask window b % nW; with a feature-map
    ``grid``, window b = image * nW + w as in the partitioned layout; with ``query``, window b
    takes image b // (B_ / B), or b % B, ``TILED_QUERY``), launched as ``plan``
    (``plan.forward_plan(call)``) says.

    Returns the output (B_, N, H*D) in qkv's dtype (with ``grid`` (B, H*W, H*D)), the softmax
    statistics and the mask's region ids and info, which the backward takes back
    (``ForwardOutputs``)."""
    qkv, mask = tensors.qkv, tensors.mask
    traced = traced_launch()
    # before the outputs are allocated: its (nW, N, N) temporaries then add less to the peak
    if plan.regions_used:
        regions, mask_info = kept_mask_structure(mask)
    else:
        regions = qkv.new_empty((0,), dtype=torch.int32)
        mask_info = qkv.new_empty((0,), dtype=torch.float32)
    out = qkv.new_empty(plan.out_shape)
    stats = qkv.new_empty(plan.stats_shape, dtype=torch.float32)
    # the kernel reads its bias tile once per program where a window is one key block, else streams it
    read_bias, read_mask = streamed_bias(call, tensors.bias, mask) if plan.streams else (tensors.bias, mask)
    _check_reads(plan, read_bias, read_mask)
    unused = unused_pointer(qkv, traced)
    table = plan.bias == TABLE_BIAS
    bias_ptr, mask_ptr, bias_strides, mask_strides = bias_mask_args(read_bias, read_mask, unused, table)
    mask_regions = plan.mask_regions
    q, stride_q_b, stride_q_n, query_windows = query_args(call, tensors.query, unused)
    for from_regions in mask_kinds_to_launch(mask_regions, mask):
        launcher(window_attention_fwd_kernel)[plan.programs](
            qkv, q, out, stats, bias_ptr, tensors.index if table else unused, mask_ptr,
            regions if mask_regions else unused, mask_info if mask_regions else unused,
            _or(tensors.logit_scale, unused), _or(tensors.seed, unused), call.scale, call.dropout_p,
            *qkv_strides(qkv, call.heads), stride_q_b, stride_q_n, *out.stride(), *bias_strides, *mask_strides,
            plan.periods, plan.per_period, plan.per_chunk, *plan.grid_args, query_windows, **plan.kwargs[from_regions],
        )
    return ForwardOutputs(out, stats, regions, mask_info)


def _or(tensor: Optional[torch.Tensor], unused: torch.Tensor) -> torch.Tensor:
    """``tensor``, or ``unused`` for a pointer that the kernel does not read."""
    return tensor if tensor is not None else unused


def qkv_strides(qkv: torch.Tensor, num_heads: int) -> Tuple[int, int, int, int, int]:
    """The strides of qkv's (window, token, q/k/v, head, dim) axes, which the kernels take:
    of qkv (B_, N, 3*H*D), q, k and v each H heads of D channels (timm's qkv linear), or of
    a (B_, N, 3, H, D) view, any strides (a qkv whose channels are (H, 3, D), or whose
    tokens are its innermost axis, is such a view of its tensor: ``window_attention``)."""
    if qkv.dim() == 5:
        return tuple(qkv.stride())
    stride_b, stride_n, stride_c = qkv.stride()
    head_dim = qkv.shape[2] // (3 * num_heads)
    return stride_b, stride_n, num_heads * head_dim * stride_c, head_dim * stride_c, stride_c


def query_args(call: WindowCall, query: Optional[torch.Tensor], unused: torch.Tensor
               ) -> Tuple[torch.Tensor, int, int, int]:
    """Where the kernels read the queries (``tiles.query_base``): (the tensor, its image
    stride, its token stride, query_windows). Without ``query`` the kernels read qkv's and
    none of these (the tensor ``unused``, zeros); with ``query`` (B, N, H*D), that tensor,
    window b taking image b // (B_ / B) (query_windows B_ / B) or, ``TILED_QUERY``, b % B
    (query_windows B). Its heads and channels are read with qkv's strides (``ops.window_checks``
    makes the two alike)."""
    if query is None:
        return unused, 0, 0, 1
    images = query.shape[0]
    return query, query.stride(0), query.stride(1), images if call.query == TILED_QUERY else call.windows // images


def attention_backward(call: WindowCall, plan: BackwardPlan, saved: WindowSaved, dout: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``attention_forward`` given dout (the output's shape), from what its call
    saved (``WindowSaved``: its tensors and outputs), launched as ``plan``
    (``plan.backward_plan(call, bias_grad, scale_grad)``) says; regenerates the forward's
    dropout from the same seed. Returns dqkv (qkv's shape and layout), dbias (H, N, N) fp32
    and d(logit_scale) (H,) fp32; the last two are empty when not asked for (and, for
    windows of one tile, views of one tensor). A bias read from its table still gets the
    dense gradient (``position_bias`` sums its table's). With ``query``, dqkv is
    (B_, N, 3, H, D): each window's dQ, which the caller sums over an image's windows, beside
    dK and dV."""
    qkv, mask, heads = saved.qkv, saved.mask, call.heads
    traced = traced_launch()
    unused = unused_pointer(qkv, traced)
    n, launches = call.tokens, plan.launches
    # region ids computed by the forward, for the kernels that stream key blocks
    mask_regions = plan.mask_regions
    stats = saved.stats
    regions, mask_info = (saved.regions, saved.mask_info) if mask_regions else (unused, unused)
    if saved.query is None:
        dqkv = torch.empty_like(qkv)  # qkv's layout where that is dense (a view's gradient is then a view)
    else:  # each window's dQ beside dK, dV (of qkv's (B_, N, 2, H, D))
        dqkv = qkv.new_empty((*qkv.shape[:2], 3, *qkv.shape[3:]))
    # the one-tile kernel reads its bias tile once per program; the others stream it
    if plan.single_tile:
        read_bias, read_mask = saved.bias, mask
    else:
        read_bias, read_mask = streamed_bias(call, saved.bias, mask)
    _check_reads(plan, read_bias, read_mask)
    table = plan.bias == TABLE_BIAS
    bias_ptr, mask_ptr, bias_strides, mask_strides = bias_mask_args(read_bias, read_mask, unused, table)
    bias_grad, scale_grad = plan.bias_grad, plan.scale_grad
    logit_scale_ptr, seed_ptr = _or(saved.logit_scale, unused), _or(saved.seed, unused)
    scale, dropout_p = call.scale, call.dropout_p
    q, stride_q_b, stride_q_n, query_windows = query_args(call, saved.query, unused)
    strides = (*qkv_strides(qkv, heads), stride_q_b, stride_q_n, *dout.stride(), *qkv_strides(dqkv, heads),
               *bias_strides, *mask_strides)
    windows = (plan.periods, plan.per_period)

    if plan.single_tile:
        partials = qkv.new_empty(plan.partials_shape, dtype=torch.float32)
        bias_size = plan.bias_size
        programs, kwargs = launches[("fused", False)]
        launcher(window_attention_bwd_fused_kernel)[programs](
            qkv, q, dout, bias_ptr, saved.index if table else unused, mask_ptr, logit_scale_ptr, seed_ptr,
            dqkv, partials, partials[:, bias_size:] if scale_grad else unused, scale, dropout_p, *strides,
            partials.stride(0), *windows, plan.per_chunk["fused"], *plan.grid_args, query_windows, **kwargs,
        )
        sums = partials.sum(0) if bias_grad or scale_grad else partials.new_empty((0,))
        # an empty tensor of its own for each gradient not asked for: a registered operator's
        # outputs may not alias each other (torch.compile and checkpointing check it)
        return (dqkv, sums[:bias_size].view(heads, n, n) if bias_grad else sums.new_empty((0,)),
                sums[bias_size:] if scale_grad else sums.new_empty((0,)))

    if stats.dim() != 4:  # (0,): not (2 or 3, B_, H, N); a static check, no guard when traced
        raise RuntimeError("window_attention backward: the forward saved no softmax statistics (it ran where "
                           "nothing required a gradient), and windows of this size need them")
    dq_atomic, slots = plan.dq_atomic, plan.slots
    # dQ summed over key blocks by the dkdv kernel's atomic adds (zeroed by the delta kernel)
    dq_acc = qkv.new_empty(plan.dq_acc_shape, dtype=torch.float32)
    delta = qkv.new_empty(plan.delta_shape, dtype=torch.float32)
    # the bias gradient's sums that atomic adds go into, zeroed by the delta kernel: the dkdv
    # kernel's slots, or the dbias kernel's one (H, N, N) sum (``BackwardPlan.atomic_sum``).
    # The backward then launches none of the four fill kernels it did (the other three were
    # autograd's zero gradients of the statistics outputs, no longer materialized:
    # window_operators.save): H200, f+b us (3 alternated rounds), window 16 V1 409.8 -> 403.3,
    # cosine 520.5 -> 511.4; window 12 357.6 -> 351.0, 462.5 -> 455.7; window 24 1147.3 ->
    # 1138.9, 1487.1 -> 1476.6.
    dbias_sums = qkv.new_empty(plan.dbias_sums_shape, dtype=torch.float32)
    # d(head scale): added up per head by the dkdv kernel with atomic dQ (zeroed by the delta
    # kernel), else partials per (window, head, query block) from the dq kernel
    dscale = qkv.new_empty(plan.dscale_shape, dtype=torch.float32)
    programs, kwargs = launches[("delta", False)]
    launcher(window_attention_bwd_delta_kernel)[programs](
        saved.out, dout, delta, dq_acc, dbias_sums, dbias_sums.numel(), -(-dbias_sums.numel() // programs[0]),
        dscale, *saved.out.stride(), *dout.stride(), **kwargs,
    )
    for from_regions in mask_kinds_to_launch(mask_regions, mask):
        programs, kwargs = launches[("dkdv", from_regions)]
        launcher(window_attention_bwd_dkdv_kernel)[programs](
            qkv, q, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dqkv,
            dq_acc, dscale, dbias_sums, scale, dropout_p, stats.stride(0), max(slots, 1), *strides,
            *windows, plan.per_chunk["dkdv"], query_windows, **kwargs,
        )
    if dq_atomic:
        programs, kwargs = launches[("dq_finish", False)]
        launcher(window_attention_bwd_dq_finish_kernel)[programs](
            qkv, q, logit_scale_ptr, dq_acc, dqkv, scale, query_windows, *qkv_strides(qkv, heads), stride_q_b,
            stride_q_n, *qkv_strides(dqkv, heads), **kwargs,
        )
        del dq_acc  # before the bias gradient's partials are allocated: a lower peak
    else:
        for from_regions in mask_kinds_to_launch(mask_regions, mask):
            programs, kwargs = launches[("dq", from_regions)]
            launcher(window_attention_bwd_dq_kernel)[programs](
                qkv, q, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dqkv,
                dscale, scale, dropout_p, plan.periods, stats.stride(0), query_windows, *strides, **kwargs,
            )
    if slots:
        # one slot is the sum itself (a reduce kernel over it took 5 us on window 16, H200)
        dbias = dbias_sums[0] if slots == 1 else dbias_sums.sum(0)
    elif bias_grad:
        atomic_sum = plan.atomic_sum
        dbias = dbias_sums if atomic_sum else qkv.new_empty(plan.dbias_partials_shape, dtype=torch.float32)
        programs, kwargs = launches[("dbias", False)]
        launcher(window_attention_bwd_dbias_kernel)[programs](
            qkv, q, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dbias,
            scale, dropout_p, stats.stride(0), *qkv_strides(qkv, heads), stride_q_b, stride_q_n, *dout.stride(),
            *bias_strides, *mask_strides, *windows, plan.per_chunk["dbias"], query_windows, **kwargs,
        )
        dbias = dbias[0] if atomic_sum else dbias.sum(0)
    else:
        dbias = qkv.new_empty((0,), dtype=torch.float32)
    return dqkv, dbias, dscale.sum((0, 2)) if scale_grad and not dq_atomic else dscale


def _check_reads(plan: Union[ForwardPlan, BackwardPlan], read_bias: Optional[torch.Tensor],
                 read_mask: Optional[torch.Tensor]) -> None:
    """The plan's bias kind and HAS_MASK are what the launch reads: the plan decided them from
    the call by ``streamed_bias``'s rules (``bias_mask.kernel_reads``), the launch from the
    tensors."""
    if (read_bias is not None) != (plan.bias != NO_BIAS) or (read_mask is not None) != plan.has_mask:
        raise RuntimeError(f"window_attention: launch plan reads bias kind {plan.bias}, mask {plan.has_mask}; the "
                           f"launch has bias {read_bias is not None}, mask {read_mask is not None}")
