"""The dense relative-position bias, gathered from its table as timm's modules gather it.

``gather_position_bias(table, index)`` is ``table[index].permute(2, 0, 1).contiguous()``,
(T, H) -> (H, N, N), as timm's V1 ``_get_rel_pos_bias`` and SwinV2's forward compute it.
In eager mode where the table takes a gradient, one kernel writes the bias, and the
backward, where PyTorch sums the bias gradient into the table with a sort of the index
in every call (index_put with accumulation, about ten small kernels: 27 us of GPU time
per layer on an H100, ``profile_op.py (removed at fc2fe00, in git)``), sums each table row's pairs, sorted
once per index tensor (``TableRows``), in one deterministic kernel
(kernels/position/bias.py). Without a gradient, in eager mode, the same gather kernel
writes the bias. Under torch.compile the same kernels run as registered operators
(inductor's own scatter of that gradient, atomic adds into the small table, took 219 of
the 284 ms of GPU time of a compiled swinv2_base_window12to24 training step on an H100,
profile_step.py (removed at fc2fe00, in git)), the pairs of a module's index sorted once, when the graph is
traced (``constant_index``), other indices' pairs sorted in the graph at every step;
without a gradient there, and on plain CPU tensors, it is the PyTorch expression itself.
SwinV2's 16 * sigmoid(table[index]) runs in the same kernels (``sigmoid_scale``).

``TableBias(table, index, ...)`` is the same bias handed to ``window_attention`` ungathered:
the attention kernels of one-tile windows read the table through the index themselves (in
eager mode within the op's own autograd node, ``ops.window``; under torch.compile and
dispatch modes in the registered operators, whose backward sums the table's gradient with
the same kernel); larger windows take the bias gathered by this file's kernel (in eager mode
within the op's node, else ``gather_position_bias``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple, Optional, Tuple

import torch

from ..kernels.tensor_cache import kept_on
from ..kernels.position.launch import relative_bias_gather, relative_bias_table_grad
from .dispatch import (call_operator, direct_launches, dispatch_free, no_dispatch_mode, register_autograd, register_op,
                       uses_kernels)


def _sorted_pairs(index: torch.Tensor, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): the pairs of ``index`` (N, N) sorted by the table row they read,
    ascending pairs within a row (N*N,) int32, and where each row's pairs start (T + 1,)."""
    rows, order = torch.sort(index.reshape(-1), stable=True)
    starts = torch.arange(num_rows + 1, device=index.device, dtype=rows.dtype)
    return order.to(torch.int32), torch.searchsorted(rows, starts).to(torch.int32)


#: how a check names an index and its table: (the function, the index's name, the table's)
GATHER_NAMES = ("gather_position_bias", "index", "table")
WINDOW_NAMES = ("window_attention", "bias.index", "bias.table")


def _index_in_range(index: torch.Tensor, num_rows: int, names: Tuple[str, str, str]) -> bool:
    """True, else a ValueError naming the argument: the index's values are rows of the table
    (one host synchronization where it is on a GPU)."""
    low, high = (int(index.min()), int(index.max())) if index.numel() else (0, 0)
    if low < 0 or high >= num_rows:
        function, index_name, table_name = names
        raise ValueError(f"{function}: `{index_name}` must hold table rows in [0, {num_rows}) (the rows of "
                         f"`{table_name}`), got values in [{low}, {high}]")
    return True


def check_index(index: torch.Tensor, num_rows: int, names: Tuple[str, str, str] = GATHER_NAMES) -> None:
    """``_index_in_range``, once per index tensor (kept on it: an in-place change, another
    table size check again). In eager mode only: traced, the values are not known."""
    if no_dispatch_mode():
        kept_on(index, "_flashwin_index_checked", lambda: _index_in_range(index, num_rows, names), num_rows)


@dataclass(frozen=True)
class TableRows:
    """``_sorted_pairs`` of an index, and the index as the attention kernels read it (int32,
    contiguous: ``index32``), computed once per index tensor in eager mode."""

    order: torch.Tensor
    offsets: torch.Tensor
    index32: torch.Tensor

    @staticmethod
    def of(index: torch.Tensor, num_rows: int, names: Tuple[str, str, str] = GATHER_NAMES) -> "TableRows":
        """Kept on the index tensor (``tensor_cache.kept_on``: an in-place change of the index,
        a new device or table size computes them again). The first call checks the index's
        range (``check_index``), one host synchronization per index tensor."""
        def compute() -> "TableRows":
            _index_in_range(index, num_rows, names)
            return TableRows(*_sorted_pairs(index, num_rows), index.to(torch.int32).contiguous())

        return kept_on(index, "_flashwin_table_rows", compute, num_rows)


@torch.compiler.assume_constant_result
def _traced_table_rows(index: torch.Tensor, table: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) of ``TableRows.of(index, len(table))``. Marked as a constant for
    torch.compile: dynamo calls it with the index's value when it traces (a module's
    buffer) and puts its result into the graph as constants, so that the compiled step
    does not sort the pairs again (a sort of the N*N pairs, arange, searchsorted): on an
    H200, 7 kernel launches and about 36 us of GPU time fewer per layer and training step
    on 7x7 windows, 24 launches and 66 us on 24x24 ones (2026-11-24, 58bb2b2). The table,
    not its row count: traced with symbolic shapes (dynamo's automatic dynamic shapes,
    after a call with a table of another size) the count is a symbol, which dynamo cannot
    hand a constant's function; a tensor it hands as its value."""
    rows = TableRows.of(index, table.shape[0])
    return rows.order, rows.offsets


def operator_table_rows(index: torch.Tensor, table: torch.Tensor, constant_index: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) of ``index``'s pairs for the registered operators' gradient of
    ``table``: constants of the compiled graph where the index is constant
    (``_traced_table_rows``), else sorted in the graph (or, in a dispatch mode, at every
    call)."""
    if constant_index and torch.compiler.is_compiling():
        return _traced_table_rows(index, table)
    return _sorted_pairs(index, table.shape[0])


class _GatherFromTable(torch.autograd.Function):
    """The eager path: the operators' kernels without their dispatch, the pairs sorted once
    (``TableGather``, as the op's eager path reads a ``TableBias``)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, table_gather: "TableGather") -> torch.Tensor:
        ctx.table_gather, ctx.table_dtype = table_gather, table.dtype
        if table_gather.sigmoid_scale:
            ctx.save_for_backward(table)
        with direct_launches():
            return table_gather.gather(table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (table,) = ctx.saved_tensors if ctx.table_gather.sigmoid_scale else (None,)
        with direct_launches():
            return ctx.table_gather.table_grad(grad, ctx.table_dtype, table), None


# ----------------------------------------------------------------- registered operators
def _gather_impl(table: torch.Tensor, index: torch.Tensor, order: Optional[torch.Tensor],
                 offsets: Optional[torch.Tensor], sigmoid_scale: float) -> torch.Tensor:
    """The bias; order and offsets (the index's pairs by table row) are for the backward
    (None where none follows)."""
    return relative_bias_gather(table, index, sigmoid_scale)


def _gather_fake(table, index, order, offsets, sigmoid_scale):
    return table.new_empty((table.shape[1], index.shape[0], index.shape[0]))


def _table_grad_impl(grad: torch.Tensor, table: torch.Tensor, index: torch.Tensor, order: torch.Tensor,
                     offsets: torch.Tensor, sigmoid_scale: float) -> torch.Tensor:
    """The table gradient, every pair checked against ``index`` (order and offsets may be
    constants of a compiled graph, sorted from the index as it was when traced)."""
    return relative_bias_table_grad(grad, order, offsets, table.shape[0], table.dtype, index=index, table=table,
                                    sigmoid_scale=sigmoid_scale)


def _table_grad_fake(grad, table, index, order, offsets, sigmoid_scale):
    return table.new_empty(table.shape)


gather_position_bias_op = register_op("gather_position_bias", _gather_impl, _gather_fake)
position_bias_table_grad_op = register_op("position_bias_table_grad", _table_grad_impl, _table_grad_fake)


def _gather_setup_context(ctx, inputs, output):
    table, index, order, offsets, sigmoid_scale = inputs
    ctx.save_for_backward(table, index, order, offsets)
    ctx.sigmoid_scale = sigmoid_scale


def _gather_backward(ctx, grad):
    table, index, order, offsets = ctx.saved_tensors
    if order is None:
        raise RuntimeError("gather_position_bias: the gather ran without the sorted pairs its gradient needs")
    grad = call_operator(position_bias_table_grad_op, grad, table, index, order, offsets, ctx.sigmoid_scale)
    return grad, None, None, None, None


register_autograd(gather_position_bias_op, _gather_backward, _gather_setup_context)


# ----------------------------------------------------------------------- public function
def check_sigmoid_scale(sigmoid_scale: Optional[float], caller: str) -> None:
    """A ``sigmoid_scale`` is None or a finite nonzero real (not a bool). Finite as ``abs(s) <
    inf`` (False for NaN), which torch.compile traces where a float input is symbolic
    (``dynamic=True`` without float specialization); ``math.isfinite`` it cannot."""
    if sigmoid_scale is not None and (isinstance(sigmoid_scale, bool) or not isinstance(sigmoid_scale, Real)
                                      or not abs(sigmoid_scale) < math.inf or sigmoid_scale == 0):
        raise ValueError(f"{caller}: `sigmoid_scale` must be None or a finite nonzero float, got {sigmoid_scale!r}")


def _check_table_index(table: torch.Tensor, index: torch.Tensor, sigmoid_scale: Optional[float]) -> None:
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.shape[0] != index.shape[1]:
        raise ValueError(f"gather_position_bias: `index` must be of shape (N, N), got "
                         f"{tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__}")
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise ValueError(f"gather_position_bias: `table` must be of shape (rows, heads), got "
                         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")
    check_sigmoid_scale(sigmoid_scale, "gather_position_bias")


def gather_position_bias(table: torch.Tensor, index: torch.Tensor, *, constant_index: bool = False,
                         sigmoid_scale: Optional[float] = None) -> torch.Tensor:
    """(H, N, N) contiguous bias ``table[index]`` from a table (T, H) and an index (N, N)
    of table rows (timm's ``relative_position_index``), or with ``sigmoid_scale`` s,
    ``s * sigmoid(table[index])`` (SwinV2's bias, s = 16) in the same kernels: the
    sigmoid in the gather, its derivative once per table row in the gradient.

    constant_index: the index is a module's buffer whose values do not change while a
    compiled graph uses it (timm's relative_position_index is a function of the window
    size, which dynamo guards on): under torch.compile its pairs are then sorted when the
    graph is traced, not in every step. Should it change in place after that, the table
    gradient's rows that it no longer matches are NaN, not silently wrong (the kernel
    checks every pair). False: sorted in the graph (the index may be any tensor).

    The index's range is checked in eager mode, on the kernels' road and PyTorch's alike
    (once per index tensor, a host synchronization; PyTorch's indexing would wrap -1 to
    the last row); under torch.compile and dispatch modes it is not: the kernels read the
    rows it names."""
    return _gather(table, index, constant_index, sigmoid_scale, GATHER_NAMES)


def _gather(table: torch.Tensor, index: torch.Tensor, constant_index: bool, sigmoid_scale: Optional[float],
            names: Tuple[str, str, str]) -> torch.Tensor:
    """``gather_position_bias``, its index's range errors naming ``names``."""
    _check_table_index(table, index, sigmoid_scale)
    scale = float(sigmoid_scale) if sigmoid_scale is not None else 0.0  # 0: no sigmoid (the kernels' switch)
    if uses_kernels(table):
        grad = table.requires_grad and torch.is_grad_enabled()
        if grad:
            if dispatch_free(table):
                return _GatherFromTable.apply(table, TableGather(TableRows.of(index, table.shape[0], names),
                                                                 table.shape[0], scale))
            return call_operator(gather_position_bias_op, table, index,
                                 *operator_table_rows(index, table, constant_index), scale)
        if dispatch_free(table):
            # Without a gradient too: PyTorch's indexing took 201 us for a window of 24x24
            # (its vectorized_gather_kernel, H200, profile_op.py (removed at fc2fe00, in git) --forward), the
            # kernel 4 us. TableRows.of checks the index's range, once per index tensor.
            TableRows.of(index, table.shape[0], names)
            with direct_launches():
                return relative_bias_gather(table, index, scale)
        if not torch.compiler.is_compiling():
            # under a dispatch mode or for a tensor subclass, the operator: its kernel gives
            # the values the gradient's path gives (an activation checkpoint's two passes,
            # the first without a gradient, agree to the bit with a sigmoid_scale too)
            return call_operator(gather_position_bias_op, table, index, None, None, scale)
    check_index(index, table.shape[0], names)  # PyTorch's road too: its indexing wraps -1
    n = index.shape[0]
    bias = table[index.reshape(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
    return scale * torch.sigmoid(bias) if scale else bias


# -------------------------------------------------------- the bias as the op takes it
class TableBias(NamedTuple):
    """A relative-position bias given by its table, for ``window_attention(..., bias=)``:
    ``table[index]`` (H, N, N), or ``sigmoid_scale * sigmoid(table[index])``, the values
    ``gather_position_bias(table, index, ...)`` gives (timm's V1 and SwinV2 biases).

    In eager mode the op then reads it, and sums the table's gradient, within its own
    autograd node: no node, no torch.autograd.Function call and no autograd bookkeeping of
    a gather of its own (host time, which eager training steps of the tiny models are bound
    by); where a window is one tile of the kernels (N <= 64) they read the table themselves
    (``kernels.window.bias_mask_tiles.table_bias``: no gather launched, no dense bias kept between
    the passes), else a gather kernel writes the bias for them. Under torch.compile, dispatch
    modes and for tensor subclasses the registered operators read the table of one-tile
    windows the same way (12 gather launches fewer per compiled swin_tiny training step),
    and take ``dense()`` for larger ones; PyTorch's path takes ``dense()``. A NamedTuple:
    torch.compile traces it as it traces a tuple.

    table: (T, H); index: (N, N) integer table rows; sigmoid_scale: None, or SwinV2's 16;
    constant_index: as ``gather_position_bias``'s.
    """

    table: torch.Tensor
    index: torch.Tensor
    sigmoid_scale: Optional[float] = None
    constant_index: bool = False

    def dense(self) -> torch.Tensor:
        """The (H, N, N) bias, ``gather_position_bias``'s (its errors name ``bias.index``, as
        ``window_attention`` takes it)."""
        return _gather(self.table, self.index, self.constant_index, self.sigmoid_scale, WINDOW_NAMES)


@dataclass(frozen=True)
class TableGather:
    """How ``gather_position_bias``'s eager road gathers a bias from its table and sums the
    table's gradient: the index's rows (``TableRows``: the int32 index, its pairs sorted by
    table row, the index's range checked once), the table's row count and the sigmoid scale
    (0: none). Call its launches in ``dispatch.direct_launches()``. (``window_attention``
    reads a ``TableBias`` in its own node: ``ops.window``.)"""

    rows: TableRows
    num_rows: int
    sigmoid_scale: float

    def gather(self, table: torch.Tensor) -> torch.Tensor:
        """The dense bias (H, N, N) in the table's dtype, read through ``rows.index32``."""
        return relative_bias_gather(table, self.rows.index32, self.sigmoid_scale)

    def table_grad(self, bias_grad: torch.Tensor, dtype: torch.dtype, table: Optional[torch.Tensor]) -> torch.Tensor:
        """The table's gradient (T, H) in ``dtype`` (the table's) from the bias gradient
        (H, N, N); ``table`` is read with a sigmoid scale only (the sigmoid's derivative)."""
        return relative_bias_table_grad(bias_grad, self.rows.order, self.rows.offsets, self.num_rows, dtype,
                                        table=table, sigmoid_scale=self.sigmoid_scale)
