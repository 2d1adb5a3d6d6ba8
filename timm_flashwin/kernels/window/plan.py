"""Plans: everything the op and the launchers decide about a call, decided once per signature.

``call_plan`` answers what the op asks of a call's shape on its device before anything is
launched: whether the kernels take it (their configurations fit the device's shared
memory), whether they read a position bias from its table, whether the backward maps the
feature-map layout, what the forward saves for the backward. ``forward_plan`` and
``backward_plan`` decide the launches: the tile configuration, the split of the windows
into programs, the grid, the kernels' constexprs and compile options. Each is computed
once per signature and kept: later calls look it up (a dict lookup on a tuple of plain
values). Eager training steps of the tiny models are bound by the host's time
(benchmarks/RESULTS.md); this is host time saved in every call.

What varies from call to call stays per call in ``launch.py`` and ``bias_mask.py``: the
tensors (their addresses and strides are launch arguments, never part of a plan), the
bias copy that kernels streaming key blocks read (kept on the bias tensor), the mask's
region ids and kind (kept on the mask tensor).

Launch plans are not kept while a launch is traced for torch.compile (its shapes may be
symbolic; inductor keeps its own decisions in the graph), and no plan is kept while
``config.OVERRIDES`` holds a configuration (tests change it between calls); the other
settings of ``config`` that decisions read are part of the signature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from . import config
from ..arch import Arch, tensor_arch
from .bias_mask import StreamedFlags, reads_mask_apart, streamed_flags
from .layout import OWN_QUERY, FeatureMap, grid_args, layout_flags, windows_tokens_channels
from ..launcher import compiler_options, launch_options


#: signature -> plan; a handful of entries per model (one per layer shape and pass)
_PLANS: Dict[Tuple, object] = {}


def clear() -> None:
    """Forget every plan (they are computed again at the next call)."""
    _PLANS.clear()


def _settings() -> Tuple:
    """The module-level settings of ``config`` that the decisions read."""
    return config.MASK_REGIONS, config.FOLDED_MASK_MAX_BYTES, config.MIN_WINDOWS_PER_PROGRAM


def _cached(key: Tuple, make):
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make()
    return plan


# ------------------------------------------------------------- the plans
@dataclass(frozen=True)
class CallPlan:
    """What the kernels do with calls of one shape (N tokens, head_dim, dtype, cosine or V1,
    dropout) on one architecture (``call_plan``)."""

    n: int
    dtype: torch.dtype
    cosine: bool
    #: why the kernels do not take this shape here (the shape in words: its configurations need
    #: more shared memory than the architecture has), None where they do
    misfit: Optional[str]
    #: a whole window is one tile of the backward: it renormalizes the rows itself (the forward
    #: saves no statistics) and reads and writes the feature-map layout
    single_tile_backward: bool
    #: a whole window is one tile of both passes: the kernels read a position bias from its table
    reads_table: bool
    #: a kernel of either pass streams key blocks, reading bias and mask tiles per key block
    streams: bool

    def maps_windows(self, backward: bool) -> bool:
        """Whether the kernels read and write the feature-map layout (``grid``): the forward
        always, the backward where a window is one tile (the kernels that stream blocks
        address windows by their partitioned rows)."""
        return not backward or self.single_tile_backward

    def stats_shape(self, num_windows: int, num_heads: int, save: bool) -> Tuple[int, ...]:
        """What the forward saves for the backward: (2, B_, H, N) row max and 1 / row sum where
        the backward streams key blocks, plus the rows' mean score and inverse norms for cosine
        attention (4, B_, H, N); nothing where a window is one backward tile, nor where no
        backward will run (``save`` False)."""
        if not save or self.single_tile_backward:
            return (0,)
        return (4 if self.cosine else 2, num_windows, num_heads, self.n)

    def regions_used(self, mask: Optional[torch.Tensor], num_heads: int) -> bool:
        """Whether a kernel streams key blocks over a mask that it reads itself (float32
        inputs; 16-bit inputs read it folded into the bias copy, ``bias_mask.streamed_bias``)
        and so uses its region ids (``bias_mask.mask_structure``), which the forward then
        computes for both passes."""
        return config.MASK_REGIONS and self.streams and reads_mask_apart(mask, self.dtype, num_heads, self.n)


def call_plan(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool, arch: Arch) -> CallPlan:
    """The ``CallPlan`` of this shape on ``arch`` (``arch.tensor_arch(qkv)``), kept per signature
    (not where a size or the dropout flag is symbolic: dynamo's tracing, an operator's
    dynamic-shape dispatch; a SymInt cannot be hashed)."""
    if (config.OVERRIDES or torch.compiler.is_compiling() or type(n) is not int or type(head_dim) is not int
            or type(dropout) is not bool):
        return _call_plan(n, head_dim, dtype, cosine, dropout, arch)
    # config.MASK_REGIONS is no part of it: ``regions_used`` reads that setting at each call
    key = ("call", n, head_dim, dtype, cosine, dropout, arch)
    return _cached(key, lambda: _call_plan(n, head_dim, dtype, cosine, dropout, arch))


def _call_plan(n, head_dim, dtype, cosine, dropout, arch) -> CallPlan:
    forward = config.forward_config(n, head_dim, dtype, cosine, dropout, arch=arch)
    backward = config.backward_config(n, head_dim, dtype, cosine, arch)
    if not config.fits(n, head_dim, dtype, cosine, dropout, arch):
        return CallPlan(n, dtype, cosine, f"windows of {n} tokens at head_dim {head_dim}", False, False, False)
    single = backward.single_tile(n)
    return CallPlan(n, dtype, cosine, None, single, single and n <= forward.block_n,
                    n > forward.block_n or not single)


def dq_by_atomic_adds(tiles: config.LaunchConfig) -> bool:
    """Whether the multi-block backward adds dQ up with atomic adds in its dkdv kernel (one
    recomputation of P fewer) rather than in a dq kernel of its own: where the launch
    configuration says it is faster (``LaunchConfig.dq_atomic``), and never under
    ``torch.use_deterministic_algorithms(True)``: the order of fp32 atomic adds varies
    from run to run, and so would the last bits of dQ and of the cosine scale gradient
    (the bias gradient's: ``dbias_slots``)."""
    return tiles.dq_atomic and not torch.are_deterministic_algorithms_enabled()


def dbias_slots(tiles: config.LaunchConfig) -> int:
    """Into how many (H, N, N) fp32 slots the multi-block dkdv kernel adds the bias gradient
    with atomic adds, 0 where a dbias kernel of its own computes it (``LaunchConfig.
    dbias_slots``; 0 under ``torch.use_deterministic_algorithms(True)``)."""
    return 0 if torch.are_deterministic_algorithms_enabled() else tiles.dbias_slots


def dbias_sum_by_atomic_adds() -> bool:
    """Whether the dbias kernel adds its programs' sums into one (H, N, N) buffer with
    atomic adds rather than writing (nW * chunks, H, N, N) partials that a sum reduces
    afterwards: always but under ``torch.use_deterministic_algorithms(True)`` (the adds'
    order varies from run to run, and so would the last bits of the bias gradient)."""
    return not torch.are_deterministic_algorithms_enabled()


def _fp32_dot(dtype: torch.dtype) -> bool:
    """The kernels' FP32_DOT: float32 inputs get exact fp32 products (no tf32). Triton's
    interpreter (3.6 to 3.9) holds bf16 as uint16 and its tl.dot multiplies those bit
    patterns as integers: products there are taken in fp32."""
    return dtype == torch.float32 or config.INTERPRET


@dataclass
class ForwardPlan:
    """The forward kernel's launch for one signature (``forward_plan``)."""

    tiles: config.LaunchConfig
    num_windows: int
    n: int
    head_dim: int
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
    #: the kernel streams key blocks: it reads the bias as ``bias_mask.streamed_bias`` gives it
    streams: bool
    table: bool
    flags: StreamedFlags
    grid_args: Tuple[int, ...]
    #: FROM_REGIONS -> the kernel's keyword arguments (constexprs and compile options)
    kwargs: Dict[bool, dict] = field(default_factory=dict)


def forward_plan(qkv: torch.Tensor, num_heads: int, has_bias: bool, mask: Optional[torch.Tensor], cosine: bool,
                 dropout: bool, save_stats: bool, grid: Optional[FeatureMap], table: bool, table_sigmoid: float,
                 traced: bool, query_mode: int = OWN_QUERY) -> ForwardPlan:
    """The forward's ``ForwardPlan`` for these inputs (``query_mode``: ``global_query``'s;
    ``traced``: the launch is traced for torch.compile)."""
    periods = mask.shape[0] if mask is not None else 1

    def make() -> ForwardPlan:
        return _forward_plan(qkv, num_heads, has_bias, mask, cosine, dropout, save_stats, grid, table, table_sigmoid,
                             query_mode, periods)
    if traced or config.OVERRIDES:
        return make()
    key = ("fwd", tuple(qkv.shape), qkv.dtype, qkv.get_device(), tensor_arch(qkv), num_heads, has_bias, mask is not None, periods,
           cosine, dropout, save_stats, grid, table, table_sigmoid, query_mode, _settings())
    return _cached(key, make)


def _forward_plan(qkv, num_heads, has_bias, mask, cosine, dropout, save_stats, grid, table, table_sigmoid,
                  query_mode, periods) -> ForwardPlan:
    dtype = qkv.dtype
    num_windows, n, channels = windows_tokens_channels(qkv, grid)
    head_dim = channels // (3 * num_heads)
    arch = tensor_arch(qkv)
    tiles = config.forward_config(n, head_dim, dtype, cosine, dropout, reads_mask_apart(mask, dtype, num_heads, n), arch)
    if table and n > tiles.block_n:
        raise ValueError(f"window_attention: the bias is read from its table in windows of one tile, N = {n} is "
                         f"more (CallPlan.reads_table)")
    call = call_plan(n, head_dim, dtype, cosine, dropout, arch)
    used = call.regions_used(mask, num_heads)
    per_period = num_windows // periods
    m_blocks = -(-n // tiles.block_m)
    chunks, per_chunk = config.split_windows(
        per_period, m_blocks * num_heads * periods, config.target_programs(arch, tiles.programs_per_sm))
    streams = n > tiles.block_n
    flags = streamed_flags(has_bias, mask is not None, streams, dtype, num_heads, periods, n)
    stats_shape = call.stats_shape(num_windows, num_heads, save_stats)
    plan = ForwardPlan(tiles, num_windows, n, head_dim, periods, per_period, per_chunk,
                       (m_blocks * num_heads * periods * chunks,), (*qkv.shape[:2], num_heads * head_dim), stats_shape,
                       used, used and streams, streams, table, flags, grid_args(grid))
    for from_regions in (False, True):
        plan.kwargs[from_regions] = dict(
            H=num_heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
            HAS_BIAS=flags.has_bias, HAS_MASK=flags.has_mask, COSINE=cosine, FP32_DOT=_fp32_dot(dtype),
            STORE_STATS=math.prod(stats_shape) > 0, HAS_DROPOUT=dropout,
            MASK_REGIONS=plan.mask_regions, FROM_REGIONS=from_regions, BIAS_LOG2E=flags.log2e,
            ONE_REGION_LOOP=tiles.one_region_loop, FLAT_LOOP=tiles.flat_loop, **layout_flags(grid),
            BIAS_TABLE=table, BIAS_SIGMOID=float(table_sigmoid), GLOBAL_QUERY=query_mode,
            **launch_options(tiles, dropout))
    return plan


@dataclass
class BackwardPlan:
    """The backward's launches for one signature (``backward_plan``): the one-tile kernel's,
    or the multi-block path's (delta, dkdv, dq or dq_finish, dbias). ``launches`` maps each
    kernel's name (with its FROM_REGIONS for the kernels built per mask kind) to its grid
    and keyword arguments."""

    tiles: config.LaunchConfig
    single_tile: bool
    num_windows: int
    n: int
    head_dim: int
    periods: int
    per_period: int
    mask_regions: bool
    flags: StreamedFlags
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


def backward_plan(qkv: torch.Tensor, num_heads: int, has_bias: bool, mask: Optional[torch.Tensor], cosine: bool,
                  bias_grad: bool, scale_grad: bool, dropout: bool, grid: Optional[FeatureMap], table: bool,
                  table_sigmoid: float, traced: bool, query_mode: int = OWN_QUERY) -> BackwardPlan:
    """The backward's ``BackwardPlan`` for these inputs (``query_mode`` and ``traced`` as
    ``forward_plan``'s)."""
    periods = mask.shape[0] if mask is not None else 1

    def make() -> BackwardPlan:
        return _backward_plan(qkv, num_heads, has_bias, mask, cosine, bias_grad, scale_grad, dropout, grid, table,
                              table_sigmoid, query_mode, periods)
    if traced or config.OVERRIDES:
        return make()
    key = ("bwd", tuple(qkv.shape), qkv.dtype, qkv.get_device(), tensor_arch(qkv), num_heads, has_bias, mask is not None, periods,
           cosine, bias_grad, scale_grad, dropout, grid, table, table_sigmoid, query_mode,
           torch.are_deterministic_algorithms_enabled(), _settings())
    return _cached(key, make)


def _backward_plan(qkv, num_heads, has_bias, mask, cosine, bias_grad, scale_grad, dropout, grid, table,
                   table_sigmoid, query_mode, periods) -> BackwardPlan:
    dtype = qkv.dtype
    num_windows, n, channels = windows_tokens_channels(qkv, grid)
    head_dim = channels // (3 * num_heads)
    arch = tensor_arch(qkv)
    tiles = config.backward_config(n, head_dim, dtype, cosine, arch)
    single = tiles.single_tile(n)
    if grid is not None and not single:
        raise ValueError(f"window_attention backward: the feature-map layout needs windows of one tile, N = {n} "
                         f"is more (CallPlan.maps_windows)")
    if table and not single:
        raise ValueError(f"window_attention backward: the bias is read from its table in windows of one tile, "
                         f"N = {n} is more (CallPlan.reads_table)")
    mask_regions = call_plan(n, head_dim, dtype, cosine, dropout, arch).regions_used(mask, num_heads) and not single
    per_period = num_windows // periods
    flags = streamed_flags(has_bias, mask is not None, not single, dtype, num_heads, periods, n)
    scale_grad = scale_grad and cosine
    plan = BackwardPlan(tiles, single, num_windows, n, head_dim, periods, per_period, mask_regions, flags, scale_grad,
                        grid_args(grid))
    common = dict(H=num_heads, N=n, D=head_dim, HAS_BIAS=flags.has_bias, HAS_MASK=flags.has_mask, COSINE=cosine,
                  FP32_DOT=_fp32_dot(dtype), HAS_DROPOUT=dropout, GLOBAL_QUERY=query_mode)
    programs = config.target_programs(arch, tiles.programs_per_sm)
    if single:
        chunks, plan.per_chunk["fused"] = config.split_windows(per_period, num_heads * periods, programs)
        groups = chunks * periods
        # each program group's partial gradients of the bias (H*N*N) and the logit scale (H), side
        # by side in one row of one buffer: one reduction sums both (a launch fewer per layer
        # with cosine attention)
        plan.bias_size = num_heads * n * n if bias_grad else 0
        plan.partials_shape = (groups, plan.bias_size + (num_heads if scale_grad else 0))
        plan.launches[("fused", False)] = ((groups * num_heads,), dict(
            BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, BIAS_GRAD=bias_grad, SCALE_GRAD=scale_grad,
            **layout_flags(grid), BIAS_TABLE=table, BIAS_SIGMOID=float(table_sigmoid),
            **launch_options(tiles, dropout), **common))
        return plan

    m_blocks, n_blocks = -(-n // tiles.block_m), -(-n // tiles.block_n)
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d)
    common.update(MASK_REGIONS=mask_regions, BIAS_LOG2E=flags.log2e)
    launch = launch_options(tiles, dropout)
    plan.dq_atomic = dq_atomic = dq_by_atomic_adds(tiles)
    plan.dq_acc_shape = (num_windows * num_heads * n, head_dim) if dq_atomic else (0,)
    plan.delta_shape = (num_windows, num_heads, n)
    plan.slots = slots = min(dbias_slots(tiles), num_windows) if bias_grad else 0
    plan.atomic_sum = bias_grad and not slots and dbias_sum_by_atomic_adds()
    sums = slots or int(plan.atomic_sum)
    plan.dbias_sums_shape = (sums, num_heads, n, n) if sums else (0,)
    plan.dscale_shape = (0,) if not scale_grad else (num_heads,) if dq_atomic else (num_windows, num_heads, m_blocks)
    delta_programs = num_windows * num_heads * m_blocks
    plan.launches[("delta", False)] = ((delta_programs,), dict(
        H=num_heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_D=tiles.block_d, DQ_ATOMIC=dq_atomic,
        ZERO_SUMS=sums > 0, ZERO_SCALE_SUMS=scale_grad and dq_atomic, **compiler_options()))
    # the dkdv kernel's programs: (key block, head, mask window, run of windows); one window
    # per program without the flat loop
    if tiles.flat_loop:
        chunks, plan.per_chunk["dkdv"] = config.split_windows(per_period, n_blocks * num_heads * periods, programs)
    else:
        chunks, plan.per_chunk["dkdv"] = per_period, 1
    rows_programs = (num_windows * num_heads * m_blocks,)
    for from_regions in (False, True):
        plan.launches[("dkdv", from_regions)] = ((n_blocks * num_heads * periods * chunks,), dict(
            DQ_ATOMIC=dq_atomic, SCALE_GRAD=scale_grad and dq_atomic, DBIAS_ATOMIC=slots > 0,
            FROM_REGIONS=from_regions, ONE_REGION_LOOP=tiles.one_region_loop, FLAT_LOOP=tiles.flat_loop,
            **blocks, **common, **launch))
        plan.launches[("dq", from_regions)] = (rows_programs, dict(
            SCALE_GRAD=scale_grad, FROM_REGIONS=from_regions, **blocks, **common, **launch))
    plan.launches[("dq_finish", False)] = (rows_programs, dict(
        H=num_heads, N=n, D=head_dim, BLOCK_M=tiles.block_m, BLOCK_D=tiles.block_d, COSINE=cosine,
        GLOBAL_QUERY=query_mode, **compiler_options()))
    if bias_grad and not slots:
        dbias_tiles = config.dbias_config(n, head_dim, dtype, cosine, arch)
        tiles_m, tiles_n = -(-n // dbias_tiles.block_m), -(-n // dbias_tiles.block_n)
        chunks, plan.per_chunk["dbias"] = config.split_windows(
            per_period, num_heads * periods * tiles_m * tiles_n,
            config.target_programs(arch, dbias_tiles.programs_per_sm))
        groups = chunks * periods
        # partials per program group, summed afterwards, where no atomic adds are allowed
        plan.dbias_partials_shape = (groups, num_heads, n, n)
        plan.launches[("dbias", False)] = ((groups * num_heads * tiles_m * tiles_n,), dict(
            BLOCK_M=dbias_tiles.block_m, BLOCK_N=dbias_tiles.block_n, BLOCK_D=dbias_tiles.block_d,
            ATOMIC_SUM=plan.atomic_sum, **common, **launch_options(dbias_tiles, dropout)))
    return plan
