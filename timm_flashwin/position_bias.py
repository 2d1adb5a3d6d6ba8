"""The dense relative-position bias, gathered from its table as timm's modules gather it.

``gather_position_bias(table, index)`` is ``table[index].permute(2, 0, 1).contiguous()``,
(T, H) -> (H, N, N), as timm's V1 ``_get_rel_pos_bias`` and SwinV2's forward compute it.
In eager mode where the table takes a gradient, one kernel writes the bias, and the
backward, where PyTorch sums the bias gradient into the table with a sort of the index
in every call (index_put with accumulation, about ten small kernels: 27 us of GPU time
per layer on an H100, ``benchmarks/profile_op.py``), sums each table row's pairs, sorted
once per index tensor (``TableRows``), in one deterministic kernel
(kernels/position_bias.py). Under torch.compile, on plain CPU tensors and without a
gradient it is the PyTorch expression itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.launch import relative_bias_gather, relative_bias_table_grad
from .op import _direct_launches, _dispatch_free, uses_kernels


@dataclass(frozen=True)
class TableRows:
    """The pairs p = (i, j) of an index (N, N) grouped by the table row they read:
    ``order`` (N*N,) int32 sorts the pairs by row (ascending pairs within a row), row t's
    pairs are order[offsets[t]:offsets[t + 1]]; ``max_count`` is the most pairs of a row."""

    order: torch.Tensor
    offsets: torch.Tensor
    max_count: int

    @staticmethod
    def of(index: torch.Tensor, num_rows: int) -> "TableRows":
        """Computed once per index tensor and kept on it (an in-place change of the index,
        a new device or table size computes them again). Its one host synchronization
        (the row counts' maximum, the range check) happens on that first call only."""
        key = (index._version, index.data_ptr(), num_rows)
        cached = index.__dict__.get("_flashwin_table_rows")
        if cached is not None and cached[0] == key:
            return cached[1]
        flat = index.reshape(-1)
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= num_rows:
            raise ValueError(f"gather_position_bias: `index` must hold table rows in [0, {num_rows}), "
                             f"got values in [{low}, {high}]")
        counts = torch.bincount(flat, minlength=num_rows)
        offsets = torch.zeros(num_rows + 1, dtype=torch.int32, device=index.device)
        offsets[1:] = counts.cumsum(0)
        rows = TableRows(torch.argsort(flat, stable=True).to(torch.int32), offsets, int(counts.max()))
        index.__dict__["_flashwin_table_rows"] = (key, rows)
        return rows


class _GatherFromTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor, rows: TableRows) -> torch.Tensor:
        ctx.rows, ctx.num_rows, ctx.table_dtype = rows, table.shape[0], table.dtype
        with _direct_launches():
            return relative_bias_gather(table, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        with _direct_launches():
            dtable = relative_bias_table_grad(grad, ctx.rows.order, ctx.rows.offsets, ctx.rows.max_count,
                                              ctx.num_rows, ctx.table_dtype)
        return dtable, None, None


def gather_position_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(H, N, N) contiguous bias ``table[index]`` from a table (T, H) and an index (N, N)
    of table rows (timm's ``relative_position_index``)."""
    if index.dim() != 2 or index.shape[0] != index.shape[1]:
        raise ValueError(f"gather_position_bias: `index` must be of shape (N, N), got {tuple(index.shape)}")
    if table.dim() != 2:
        raise ValueError(f"gather_position_bias: `table` must be of shape (rows, heads), got {tuple(table.shape)}")
    if table.requires_grad and torch.is_grad_enabled() and uses_kernels(table) and _dispatch_free(table):
        return _GatherFromTable.apply(table, index, TableRows.of(index, table.shape[0]))
    n = index.shape[0]
    return table[index.reshape(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
