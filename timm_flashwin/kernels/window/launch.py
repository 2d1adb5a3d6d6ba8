"""Host side of the attention kernels: allocate the outputs, launch the forward's and the
backward's kernels for one call.

What to launch is decided once per signature (``plan``); how the kernels read the bias
and the mask (the float16 copy, the mask's region ids) is prepared by ``bias_mask``; how
a launch goes out (traced or direct) is ``launcher``'s. These functions take validated
tensors (see ``timm_flashwin.ops.window``) and are written with torch operations and
``launcher`` launches only, so that ``torch.library.triton_op`` can trace them under
torch.compile.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .backward import window_attention_bwd_fused_kernel
from .backward_dkdv import window_attention_bwd_delta_kernel, window_attention_bwd_dkdv_kernel
from .backward_dq_dbias import (window_attention_bwd_dbias_kernel, window_attention_bwd_dq_finish_kernel,
                                window_attention_bwd_dq_kernel)
from .bias_mask import bias_mask_args, kept_mask_structure, mask_kinds_to_launch, streamed_bias
from .forward import window_attention_fwd_kernel
from ..launcher import launcher, traced_launch, unused_pointer
from .layout import FeatureMap, global_query
from .plan import BackwardPlan, ForwardPlan, backward_plan, forward_plan


def attention_forward(
    qkv: torch.Tensor,
    num_heads: int,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor],
    scale: float,
    cosine: bool,
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    save_stats: bool = True,
    grid: Optional[FeatureMap] = None,
    table_index: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
    query: Optional[torch.Tensor] = None,
    query_tiled: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(S + bias + mask) V per window and head, S = scale * Q K^T (V1) or, with
    ``cosine``, exp(min(logit_scale, ln 100)) * Q^ K^^T (rows normalized); from qkv
    (B_, N, 3*H*D), or a (B_, N, 3, H, D) view of it (``qkv_strides``), bias (H, N, N)
    and mask (nW, N, N), window b taking mask window b % nW.

    Returns out (B_, N, H*D) in qkv's dtype, the softmax statistics (fp32,
    ``plan.CallPlan.stats_shape``; empty without ``save_stats``, where no backward follows)
    and the mask's region ids and info (``bias_mask.mask_structure``; empty where unused),
    which the backward takes back. ``logit_scale``: the cosine logit scale as the module holds
    it, (H,) (the kernels clamp and exponentiate it), None for V1. ``seed``: a
    one-element int64 tensor, with dropout_p > 0. ``grid``: qkv is in the feature-map layout
    (B, H*W, 3*H*D) of that ``FeatureMap`` (a ``WindowGrid``); out is then (B, H*W, H*D), and window
    b = image * nW + w as in the partitioned layout. ``table_index``: ``bias`` is a table (T, H)
    and this (N, N) int32 contiguous index says which of its rows each token pair reads,
    ``table_sigmoid`` the sigmoid scale (0: none), read in the kernel (``plan.reads_table``).
    ``query``: the queries, (B, N, H*D), one per image, shared by its windows (GCViT's global
    query): qkv is then (B_, N, 2, H, D), keys and values, and window b takes image
    b // (B_ / B), or b % B with ``query_tiled`` (``query_args``)."""
    table = table_index is not None
    traced = traced_launch()
    plan = forward_plan(qkv, num_heads, bias is not None, mask, cosine, dropout_p > 0, save_stats, grid, table,
                        table_sigmoid, traced, global_query(query, query_tiled))
    # before the outputs are allocated: its (nW, N, N) temporaries then add less to the peak
    if plan.regions_used:
        regions, mask_info = kept_mask_structure(mask)
    else:
        regions = qkv.new_empty((0,), dtype=torch.int32)
        mask_info = qkv.new_empty((0,), dtype=torch.float32)
    out = qkv.new_empty(plan.out_shape)
    stats = qkv.new_empty(plan.stats_shape, dtype=torch.float32)
    # the kernel reads its bias tile once per program where a window is one key block, else streams it
    read_bias, read_mask, _ = (streamed_bias(bias, mask, qkv.dtype, num_heads) if plan.streams
                               else (bias, mask, False))
    _check_flags(plan, read_bias, read_mask)
    unused = unused_pointer(qkv, traced)
    bias_ptr, mask_ptr, bias_strides, mask_strides = bias_mask_args(read_bias, read_mask, unused, table)
    mask_regions = plan.mask_regions
    q, stride_q_b, stride_q_n, query_windows = query_args(qkv, query, query_tiled, unused)
    for from_regions in mask_kinds_to_launch(mask_regions, mask):
        launcher(window_attention_fwd_kernel)[plan.programs](
            qkv, q, out, stats, bias_ptr, table_index if table else unused, mask_ptr,
            regions if mask_regions else unused, mask_info if mask_regions else unused,
            logit_scale if logit_scale is not None else unused,
            seed if dropout_p > 0 else unused,
            scale, dropout_p,
            *qkv_strides(qkv, num_heads), stride_q_b, stride_q_n, *out.stride(), *bias_strides, *mask_strides,
            plan.periods, plan.per_period, plan.per_chunk, *plan.grid_args, query_windows, **plan.kwargs[from_regions],
        )
    return out, stats, regions, mask_info


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


def query_args(qkv: torch.Tensor, query: Optional[torch.Tensor], tiled: bool, unused: torch.Tensor
               ) -> Tuple[torch.Tensor, int, int, int]:
    """Where the kernels read the queries (``tiles.query_base``): (the tensor, its image
    stride, its token stride, query_windows). Without ``query`` the kernels read qkv's and
    none of these (the tensor ``unused``, zeros); with ``query`` (B, N, H*D), that tensor,
    window b taking image b // (B_ / B) (query_windows B_ / B) or, ``tiled``, b % B
    (query_windows B). Its heads and channels are read with qkv's strides (``op`` makes the
    two alike)."""
    if query is None:
        return unused, 0, 0, 1
    images = query.shape[0]
    return query, query.stride(0), query.stride(1), images if tiled else qkv.shape[0] // images


def attention_backward(
    dout: torch.Tensor,
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
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    grid: Optional[FeatureMap] = None,
    table_index: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
    query: Optional[torch.Tensor] = None,
    query_tiled: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``attention_forward`` given dout (out's shape). Takes the forward's
    inputs and its out, stats, regions and mask_info; regenerates the forward's dropout
    from the same ``seed``. Returns dqkv (qkv's shape and layout), dbias (H, N, N)
    fp32 and d(logit_scale) (H,) fp32; the last two are empty when not asked for (and, for
    windows of one tile, views of one tensor).
    ``grid``: as the forward's, where ``plan.maps_windows`` allows it; ``table_index`` and
    ``table_sigmoid``: as the forward's (the bias gradient is still the dense one). With
    ``query`` (``query_tiled``) as the forward's, dqkv is (B_, N, 3, H, D): each window's dQ,
    which the caller sums over an image's windows, beside dK and dV."""
    table = table_index is not None
    traced = traced_launch()
    plan = backward_plan(qkv, num_heads, bias is not None, mask, cosine, bias_grad, scale_grad, dropout_p > 0, grid,
                         table, table_sigmoid, traced, global_query(query, query_tiled))
    unused = unused_pointer(qkv, traced)
    n, launches = plan.n, plan.launches
    # region ids computed by the forward, for the kernels that stream key blocks
    mask_regions = plan.mask_regions
    if not mask_regions:
        regions, mask_info = unused, unused
    if query is None:
        dqkv = torch.empty_like(qkv)  # qkv's layout where that is dense (a view's gradient is then a view)
    else:  # each window's dQ beside dK, dV (of qkv's (B_, N, 2, H, D))
        dqkv = qkv.new_empty((*qkv.shape[:2], 3, *qkv.shape[3:]))
    # the one-tile kernel reads its bias tile once per program; the others stream it
    if plan.single_tile:
        read_bias, read_mask = bias, mask
    else:
        read_bias, read_mask, _ = streamed_bias(bias, mask, qkv.dtype, num_heads)
    _check_flags(plan, read_bias, read_mask)
    bias_ptr, mask_ptr, bias_strides, mask_strides = bias_mask_args(read_bias, read_mask, unused, table)
    scale_grad = plan.scale_grad
    logit_scale_ptr = logit_scale if logit_scale is not None else unused
    seed_ptr = seed if dropout_p > 0 else unused
    q, stride_q_b, stride_q_n, query_windows = query_args(qkv, query, query_tiled, unused)
    strides = (*qkv_strides(qkv, num_heads), stride_q_b, stride_q_n, *dout.stride(), *qkv_strides(dqkv, num_heads),
               *bias_strides, *mask_strides)
    windows = (plan.periods, plan.per_period)

    if plan.single_tile:
        partials = qkv.new_empty(plan.partials_shape, dtype=torch.float32)
        bias_size = plan.bias_size
        programs, kwargs = launches[("fused", False)]
        launcher(window_attention_bwd_fused_kernel)[programs](
            qkv, q, dout, bias_ptr, table_index if table else unused, mask_ptr, logit_scale_ptr, seed_ptr,
            dqkv, partials, partials[:, bias_size:] if scale_grad else unused, scale, dropout_p, *strides,
            partials.stride(0), *windows, plan.per_chunk["fused"], *plan.grid_args, query_windows, **kwargs,
        )
        sums = partials.sum(0) if bias_grad or scale_grad else partials.new_empty((0,))
        # an empty tensor of its own for each gradient not asked for: a registered operator's
        # outputs may not alias each other (torch.compile and checkpointing check it)
        return (dqkv, sums[:bias_size].view(num_heads, n, n) if bias_grad else sums.new_empty((0,)),
                sums[bias_size:] if scale_grad else sums.new_empty((0,)))

    if stats.dim() != 4:  # (0,): not (2 or 3, B_, H, N); a static check, no guard when traced
        raise RuntimeError("window_attention backward: the forward saved no softmax statistics (it ran where "
                           "nothing required a gradient), and windows of this size need them")
    dq_atomic, slots = plan.dq_atomic, plan.slots
    # dQ summed over key blocks by the dkdv kernel's atomic adds (zeroed by the delta kernel)
    dq_acc = qkv.new_empty(plan.dq_acc_shape, dtype=torch.float32)
    delta = qkv.new_empty(plan.delta_shape, dtype=torch.float32)
    # the bias gradient's sums that atomic adds go into, zeroed by the delta kernel: the dkdv
    # kernel's slots, or the dbias kernel's one (H, N, N) sum (``plan.dbias_sum_by_atomic_adds``).
    # The backward then launches none of the four fill kernels it did (the other three were
    # autograd's zero gradients of the statistics outputs, no longer materialized:
    # op._setup_context): H200, f+b us (3 alternated rounds), window 16 V1 409.8 -> 403.3,
    # cosine 520.5 -> 511.4; window 12 357.6 -> 351.0, 462.5 -> 455.7; window 24 1147.3 ->
    # 1138.9, 1487.1 -> 1476.6.
    dbias_sums = qkv.new_empty(plan.dbias_sums_shape, dtype=torch.float32)
    # d(head scale): added up per head by the dkdv kernel with atomic dQ (zeroed by the delta
    # kernel), else partials per (window, head, query block) from the dq kernel
    dscale = qkv.new_empty(plan.dscale_shape, dtype=torch.float32)
    programs, kwargs = launches[("delta", False)]
    launcher(window_attention_bwd_delta_kernel)[programs](
        out, dout, delta, dq_acc, dbias_sums, dbias_sums.numel(), -(-dbias_sums.numel() // programs[0]), dscale,
        *out.stride(), *dout.stride(), **kwargs,
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
            qkv, q, logit_scale_ptr, dq_acc, dqkv, scale, query_windows, *qkv_strides(qkv, num_heads), stride_q_b,
            stride_q_n, *qkv_strides(dqkv, num_heads), **kwargs,
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
            scale, dropout_p, stats.stride(0), *qkv_strides(qkv, num_heads), stride_q_b, stride_q_n, *dout.stride(),
            *bias_strides, *mask_strides, *windows, plan.per_chunk["dbias"], query_windows, **kwargs,
        )
        dbias = dbias[0] if atomic_sum else dbias.sum(0)
    else:
        dbias = qkv.new_empty((0,), dtype=torch.float32)
    return dqkv, dbias, dscale.sum((0, 2)) if scale_grad and not dq_atomic else dscale


def _check_flags(plan: Union[ForwardPlan, BackwardPlan], read_bias: Optional[torch.Tensor],
                 read_mask: Optional[torch.Tensor]) -> None:
    """The plan's HAS_BIAS and HAS_MASK are what the launch reads: the plan decided them
    from the signature by ``streamed_bias``'s rules (``bias_mask.streamed_flags``), the
    launch from the tensors."""
    if (read_bias is not None) != plan.flags.has_bias or (read_mask is not None) != plan.flags.has_mask:
        raise RuntimeError(f"window_attention: launch plan reads bias {plan.flags.has_bias}, mask "
                           f"{plan.flags.has_mask}; the launch has bias {read_bias is not None}, mask "
                           f"{read_mask is not None}")
