"""Plans: everything decided about a call, made once from its description and kept by it.

A call's description (``call.WindowCall``) holds every static property of the call and the
settings its decisions read. ``call_plan`` answers what the op asks before it launches
anything: whether the kernels take the call on its device (their configurations fit the
device's shared memory), whether they read a position bias from its table, whether the
backward maps the feature-map layout, what the forward saves. ``forward_plan`` and
``backward_plan`` decide the launches: the tile configuration, the split of the windows into
programs, the grid, the kernels' constexprs and compile options. Each is made once per
description and kept; later calls look it up (a dict lookup of the description). Eager
training steps of the tiny models are bound by the host's time (benchmarks/RESULTS.md): this
is host time saved in every call.

What varies from call to call stays per call in ``launch.py`` and ``bias_mask.py``: the
tensors (their addresses and strides are launch arguments, never part of a plan), the bias
copy that kernels streaming key blocks read (kept on the bias tensor), the mask's region ids
and kind (kept on the mask tensor).

Nothing is kept while ``config.OVERRIDES`` holds a configuration (tests change it between
calls) or while torch.compile traces (sizes may be symbolic; a traced launch's options are
inductor's, ``launcher.launch_options``), nor for a description that cannot be hashed (a
symbolic size under an operator's dynamic-shape dispatch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from . import config
from ..arch import INTERPRET
from .bias_mask import kernel_reads, reads_mask_apart
from .call import NO_BIAS, TABLE_BIAS, WindowCall
from ..launcher import compiler_options, launch_options, traced_launch
from .layout import grid_args, layout_flags
from ..sizes import cdiv

_CALL_PLANS: Dict[WindowCall, "CallPlan"] = {}
_FORWARD_PLANS: Dict[WindowCall, "ForwardPlan"] = {}
_BACKWARD_PLANS: Dict[Tuple[WindowCall, bool, bool], "BackwardPlan"] = {}


def clear() -> None:
    """Forget every plan (they are made again at the next call)."""
    for plans in (_CALL_PLANS, _FORWARD_PLANS, _BACKWARD_PLANS):
        plans.clear()


def _kept(plans: Dict, key, make: Callable, launches: bool):
    """``make()``, kept in ``plans`` under ``key`` where it may be (the module's docstring);
    ``launches``: the plan holds launch options, which differ where a launch is traced."""
    if config.OVERRIDES or torch.compiler.is_compiling() or (launches and traced_launch()):
        return make()
    try:
        plan = plans.get(key)
    except TypeError:  # a SymInt in the description: it cannot be hashed
        return make()
    if plan is None:
        plan = plans[key] = make()
    return plan


# ------------------------------------------------------------- the call's plan
@dataclass(frozen=True)
class CallPlan:
    """What the kernels do with a call (``call_plan``), the answers the op reads."""

    #: why the kernels do not take this call here (its shape in words: its configurations need
    #: more shared memory than the architecture has), None where they do
    misfit: Optional[str]
    #: a whole window is one tile of the backward: it renormalizes the rows itself (the forward
    #: saves no statistics) and reads and writes the feature-map layout
    single_tile_backward: bool
    #: a whole window is one tile of both passes: the kernels read a ``TABLE_BIAS`` from its table
    reads_table: bool
    #: a kernel of either pass streams key blocks, reading bias and mask tiles per key block
    streams: bool
    #: a kernel streams key blocks over a mask that it reads itself (float32 inputs; 16-bit
    #: inputs read it folded into the bias copy, ``bias_mask.streamed_bias``) and so uses its
    #: region ids (``bias_mask.mask_structure``), which the forward computes for both passes
    regions_used: bool

    def maps_windows(self, backward: bool) -> bool:
        """Whether the kernels read and write the feature-map layout (``grid``): the forward
        always, the backward where a window is one tile (the kernels that stream blocks
        address windows by their partitioned rows)."""
        return not backward or self.single_tile_backward

    def stats_shape(self, call: WindowCall) -> Tuple[int, ...]:
        """What the forward saves for the backward: (2, B_, H, N) row max and 1 / row sum where
        the backward streams key blocks, plus the rows' mean score and inverse norms for cosine
        attention (4, B_, H, N); nothing where a window is one backward tile, nor where no
        backward will follow (``save_stats`` False)."""
        if not call.save_stats or self.single_tile_backward:
            return (0,)
        return (4 if call.cosine else 2, call.windows, call.heads, call.tokens)


def call_plan(call: WindowCall) -> CallPlan:
    """The ``CallPlan`` of ``call``, kept by it."""
    return _kept(_CALL_PLANS, call, lambda: _call_plan(call), launches=False)


def _call_plan(call: WindowCall) -> CallPlan:
    n, head_dim, dtype, cosine, dropout, arch = (call.tokens, call.head_dim, call.dtype, call.cosine, call.dropout,
                                                 call.arch)
    forward = config.forward_config(n, head_dim, dtype, cosine, dropout, arch=arch)
    backward = config.backward_config(n, head_dim, dtype, cosine, arch)
    if not config.fits(n, head_dim, dtype, cosine, dropout, arch):
        return CallPlan(f"windows of {n} tokens at head_dim {head_dim}", False, False, False, False)
    single = backward.single_tile(n)
    streams = n > forward.block_n or not single
    return CallPlan(None, single, single and n <= forward.block_n, streams,
                    call.settings.mask_regions and streams and reads_mask_apart(call))


def dq_by_atomic_adds(tiles: config.LaunchConfig, deterministic: bool) -> bool:
    """Whether the multi-block backward adds dQ up with atomic adds in its dkdv kernel (one
    recomputation of P fewer) rather than in a dq kernel of its own: where the launch
    configuration says it is faster (``LaunchConfig.dq_atomic``), and never under
    ``torch.use_deterministic_algorithms(True)``: the order of fp32 atomic adds varies
    from run to run, and so would the last bits of dQ and of the cosine scale gradient
    (the bias gradient's: ``dbias_slots``)."""
    return tiles.dq_atomic and not deterministic


def dbias_slots(tiles: config.LaunchConfig, deterministic: bool) -> int:
    """Into how many (H, N, N) fp32 slots the multi-block dkdv kernel adds the bias gradient
    with atomic adds, 0 where a dbias kernel of its own computes it (``LaunchConfig.
    dbias_slots``; 0 under ``torch.use_deterministic_algorithms(True)``)."""
    return 0 if deterministic else tiles.dbias_slots


def _fp32_dot(dtype: torch.dtype) -> bool:
    """The kernels' FP32_DOT: float32 inputs get exact fp32 products (no tf32). Triton's
    interpreter (3.6 to 3.9) holds bf16 as uint16 and its tl.dot multiplies those bit
    patterns as integers: products there are taken in fp32."""
    return dtype == torch.float32 or INTERPRET


def _table_sigmoid(call: WindowCall, bias: int) -> float:
    """The kernels' BIAS_SIGMOID: the table's sigmoid scale where they read the table, else 0
    (a constexpr: one build for every kind that does not read it)."""
    return float(call.sigmoid) if bias == TABLE_BIAS else 0.0


# ------------------------------------------------------------- the forward's launch
@dataclass
class ForwardPlan:
    """The forward kernel's launch for one call (``forward_plan``)."""

    tiles: config.LaunchConfig
    periods: int
    per_period: int
    per_chunk: int
    programs: Tuple[int]
    out_shape: Tuple[int, ...]
    stats_shape: Tuple[int, ...]
    #: the forward computes the mask's region ids for both passes (``CallPlan.regions_used``)
    regions_used: bool
    #: this kernel streams key blocks over them
    mask_regions: bool
    #: the kernel streams key blocks: it reads the bias and the mask as ``bias_mask.streamed_bias`` gives them
    streams: bool
    #: what it reads: ``call.NO_BIAS`` ... (``bias_mask.kernel_reads``), and whether a mask
    bias: int
    has_mask: bool
    grid_args: Tuple[int, ...]
    #: FROM_REGIONS -> the kernel's keyword arguments (constexprs and compile options)
    kwargs: Dict[bool, dict] = field(default_factory=dict)


def forward_plan(call: WindowCall) -> ForwardPlan:
    """The forward's ``ForwardPlan`` for ``call``, kept by it."""
    return _kept(_FORWARD_PLANS, call, lambda: _forward_plan(call), launches=True)


def _out_shape(call: WindowCall) -> Tuple[int, ...]:
    """(B_, N, H*D), or with the feature-map layout qkv's (B, H*W, H*D)."""
    grid, channels = call.grid, call.heads * call.head_dim
    if grid is None:
        return call.windows, call.tokens, channels
    return call.windows // grid.num_windows, grid.height * grid.width, channels


def _forward_plan(call: WindowCall) -> ForwardPlan:
    n, heads, head_dim, dtype, arch = call.tokens, call.heads, call.head_dim, call.dtype, call.arch
    tiles = config.forward_config(n, head_dim, dtype, call.cosine, call.dropout, reads_mask_apart(call), arch)
    answers = call_plan(call)
    periods = call.periods or 1
    per_period = call.windows // periods
    m_blocks = cdiv(n, tiles.block_m)
    chunks, per_chunk = config.split_windows(per_period, m_blocks * heads * periods,
                                             config.target_programs(arch, tiles.programs_per_sm),
                                             call.settings.min_windows_per_program)
    streams = n > tiles.block_n
    bias, has_mask = kernel_reads(call, streams, answers.reads_table)
    stats_shape = answers.stats_shape(call)
    used = answers.regions_used
    plan = ForwardPlan(tiles, periods, per_period, per_chunk, (m_blocks * heads * periods * chunks,),
                       _out_shape(call), stats_shape, used, used and streams, streams, bias, has_mask,
                       grid_args(call.grid))
    for from_regions in (False, True):
        plan.kwargs[from_regions] = dict(
            H=heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
            BIAS=bias, HAS_MASK=has_mask, COSINE=call.cosine, FP32_DOT=_fp32_dot(dtype),
            STORE_STATS=math.prod(stats_shape) > 0, HAS_DROPOUT=call.dropout,
            MASK_REGIONS=plan.mask_regions, FROM_REGIONS=from_regions,
            ONE_REGION_LOOP=tiles.one_region_loop, FLAT_LOOP=tiles.flat_loop, **layout_flags(call.grid),
            BIAS_SIGMOID=_table_sigmoid(call, bias), GLOBAL_QUERY=call.query,
            **launch_options(tiles, call.dropout))
    return plan


# ------------------------------------------------------------- the backward's launches
@dataclass
class BackwardPlan:
    """The backward's launches for one call and the gradients asked of it (``backward_plan``):
    the one-tile kernel's, or the multi-block path's (delta, dkdv, dq or dq_finish, dbias).
    ``launches`` maps each kernel's name (with its FROM_REGIONS for the kernels built per mask
    kind) to its grid and keyword arguments."""

    tiles: config.LaunchConfig
    single_tile: bool
    periods: int
    per_period: int
    mask_regions: bool
    bias: int
    has_mask: bool
    bias_grad: bool
    scale_grad: bool
    grid_args: Tuple[int, ...]
    #: one-tile: the partial sums' buffer (groups, H*N*N + H) and the bias part's size
    partials_shape: Tuple[int, ...] = ()
    bias_size: int = 0
    #: multi-block
    dq_atomic: bool = False
    slots: int = 0
    atomic_sum: bool = False
    dq_acc_shape: Tuple[int, ...] = (0,)
    delta_shape: Tuple[int, ...] = (0,)
    dbias_sums_shape: Tuple[int, ...] = (0,)
    dscale_shape: Tuple[int, ...] = (0,)
    dbias_partials_shape: Tuple[int, ...] = (0,)
    per_chunk: Dict[str, int] = field(default_factory=dict)
    launches: Dict[Tuple[str, bool], Tuple[Tuple[int], dict]] = field(default_factory=dict)


def backward_plan(call: WindowCall, bias_grad: bool, scale_grad: bool) -> BackwardPlan:
    """The backward's ``BackwardPlan`` for ``call``, the bias's gradient asked where
    ``bias_grad``, the logit scale's where ``scale_grad``; kept by the three."""
    return _kept(_BACKWARD_PLANS, (call, bias_grad, scale_grad), lambda: _backward_plan(call, bias_grad, scale_grad),
                 launches=True)


def _backward_plan(call: WindowCall, bias_grad: bool, scale_grad: bool) -> BackwardPlan:
    n, heads, head_dim, dtype, arch, cosine = (call.tokens, call.heads, call.head_dim, call.dtype, call.arch,
                                               call.cosine)
    deterministic = call.settings.deterministic
    tiles = config.backward_config(n, head_dim, dtype, cosine, arch)
    single = tiles.single_tile(n)
    if call.grid is not None and not single:
        raise ValueError(f"window_attention backward: the feature-map layout needs windows of one tile, N = {n} "
                         f"is more (CallPlan.maps_windows)")
    answers = call_plan(call)
    mask_regions = answers.regions_used and not single
    periods = call.periods or 1
    per_period = call.windows // periods
    bias, has_mask = kernel_reads(call, not single, answers.reads_table)
    bias_grad = bias_grad and bias != NO_BIAS
    scale_grad = scale_grad and cosine
    plan = BackwardPlan(tiles, single, periods, per_period, mask_regions, bias, has_mask, bias_grad, scale_grad,
                        grid_args(call.grid))
    common = dict(H=heads, N=n, D=head_dim, BIAS=bias, HAS_MASK=has_mask, COSINE=cosine,
                  FP32_DOT=_fp32_dot(dtype), HAS_DROPOUT=call.dropout, GLOBAL_QUERY=call.query)
    programs = config.target_programs(arch, tiles.programs_per_sm)
    fewest = call.settings.min_windows_per_program
    if single:
        chunks, plan.per_chunk["fused"] = config.split_windows(per_period, heads * periods, programs, fewest)
        groups = chunks * periods
        # each program group's partial gradients of the bias (H*N*N) and the logit scale (H), side
        # by side in one row of one buffer: one reduction sums both (a launch fewer per layer
        # with cosine attention)
        plan.bias_size = heads * n * n if bias_grad else 0
        plan.partials_shape = (groups, plan.bias_size + (heads if scale_grad else 0))
        plan.launches[("fused", False)] = ((groups * heads,), dict(
            BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, BIAS_GRAD=bias_grad, SCALE_GRAD=scale_grad,
            **layout_flags(call.grid), BIAS_SIGMOID=_table_sigmoid(call, bias),
            **launch_options(tiles, call.dropout), **common))
        return plan

    m_blocks, n_blocks = cdiv(n, tiles.block_m), cdiv(n, tiles.block_n)
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d)
    common.update(MASK_REGIONS=mask_regions)
    launch = launch_options(tiles, call.dropout)
    windows = call.windows
    plan.dq_atomic = dq_atomic = dq_by_atomic_adds(tiles, deterministic)
    plan.dq_acc_shape = (windows * heads * n, head_dim) if dq_atomic else (0,)
    plan.delta_shape = (windows, heads, n)
    plan.slots = slots = min(dbias_slots(tiles, deterministic), windows) if bias_grad else 0
    # the dbias kernel adds its programs' sums into one (H, N, N) buffer with atomic adds, but
    # under torch.use_deterministic_algorithms(True), where it writes (nW * chunks, H, N, N)
    # partials that a sum reduces in a fixed order
    plan.atomic_sum = bias_grad and not slots and not deterministic
    sums = slots or int(plan.atomic_sum)
    plan.dbias_sums_shape = (sums, heads, n, n) if sums else (0,)
    plan.dscale_shape = (0,) if not scale_grad else (heads,) if dq_atomic else (windows, heads, m_blocks)
    delta_programs = windows * heads * m_blocks
    plan.launches[("delta", False)] = ((delta_programs,), dict(
        H=heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_D=tiles.block_d, DQ_ATOMIC=dq_atomic,
        ZERO_SUMS=sums > 0, ZERO_SCALE_SUMS=scale_grad and dq_atomic, **compiler_options()))
    # the dkdv kernel's programs: (key block, head, mask window, run of windows); one window
    # per program without the flat loop
    if tiles.flat_loop:
        chunks, plan.per_chunk["dkdv"] = config.split_windows(per_period, n_blocks * heads * periods, programs,
                                                              fewest)
    else:
        chunks, plan.per_chunk["dkdv"] = per_period, 1
    rows_programs = (windows * heads * m_blocks,)
    for from_regions in (False, True):
        plan.launches[("dkdv", from_regions)] = ((n_blocks * heads * periods * chunks,), dict(
            DQ_ATOMIC=dq_atomic, SCALE_GRAD=scale_grad and dq_atomic, DBIAS_ATOMIC=slots > 0,
            FROM_REGIONS=from_regions, ONE_REGION_LOOP=tiles.one_region_loop, FLAT_LOOP=tiles.flat_loop,
            **blocks, **common, **launch))
        plan.launches[("dq", from_regions)] = (rows_programs, dict(
            SCALE_GRAD=scale_grad, FROM_REGIONS=from_regions, **blocks, **common, **launch))
    plan.launches[("dq_finish", False)] = (rows_programs, dict(
        H=heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_D=tiles.block_d, COSINE=cosine,
        GLOBAL_QUERY=call.query, **compiler_options()))
    if bias_grad and not slots:
        dbias_tiles = config.dbias_config(n, head_dim, dtype, cosine, arch)
        tiles_m, tiles_n = cdiv(n, dbias_tiles.block_m), cdiv(n, dbias_tiles.block_n)
        chunks, plan.per_chunk["dbias"] = config.split_windows(
            per_period, heads * periods * tiles_m * tiles_n, config.target_programs(arch, dbias_tiles.programs_per_sm),
            fewest)
        groups = chunks * periods
        # partials per program group, summed afterwards, where no atomic adds are allowed
        plan.dbias_partials_shape = (groups, heads, n, n)
        plan.launches[("dbias", False)] = ((groups * heads * tiles_m * tiles_n,), dict(
            BLOCK_M=dbias_tiles.block_m, BLOCK_N=dbias_tiles.block_n, BLOCK_D=dbias_tiles.block_d,
            ATOMIC_SUM=plan.atomic_sum, **common, **launch_options(dbias_tiles, call.dropout)))
    return plan
