"""Host side of the position-bias kernels: the bias gathered from its table and the table's
gradient (kernels/position/bias.py), and the position MLP's table and weight gradients
(kernels/position/mlp.py). Launched as ``launch.py``'s attention kernels are
(``launcher.launcher``), traceable by torch.compile."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..arch import INTERPRET
from ..launcher import compiler_options, launcher
from .bias import relative_bias_gather_kernel, relative_bias_table_grad_kernel
from .mlp import position_mlp_bwd_kernel, position_mlp_fwd_kernel


def _heads_block(heads: int, at_least: int = 2) -> int:
    """The power of two (at least ``at_least``) that holds every head of a position-bias table."""
    return max(at_least, 1 << (heads - 1).bit_length())


def relative_bias_gather(table: torch.Tensor, index: torch.Tensor, sigmoid_scale: float = 0.0) -> torch.Tensor:
    """The dense bias (H, N, N), contiguous, table[index] from a table (T, H) and an index
    (N, N) of table rows: ``table[index.view(-1)].view(N, N, H).permute(2, 0, 1)``, or
    ``sigmoid_scale * sigmoid(...)`` of it where sigmoid_scale is not 0 (SwinV2: 16)."""
    n, heads = index.shape[0], table.shape[1]
    out = table.new_empty((heads, n, n))
    block_h = _heads_block(heads)
    block_p = max(16, (8192 if INTERPRET else 2048) // block_h)
    launcher(relative_bias_gather_kernel)[(-(-(n * n) // block_p),)](
        table, index.reshape(-1), out, n * n, *table.stride(), out.stride(0),
        H=heads, BLOCK_P=block_p, BLOCK_H=block_h, SIGMOID_SCALE=float(sigmoid_scale), **compiler_options(),
    )
    return out


def relative_bias_table_grad(grad: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, num_rows: int,
                             dtype: torch.dtype, index: Optional[torch.Tensor] = None,
                             table: Optional[torch.Tensor] = None, sigmoid_scale: float = 0.0) -> torch.Tensor:
    """Gradient (num_rows, H) in ``dtype`` of a table gathered into a dense bias (H, N, N)
    whose gradient is ``grad``; order and offsets group the pairs by table row
    (``position_bias.TableRows``). With ``index`` (N, N), the kernel checks every pair
    against it: rows whose pairs were sorted from another index are NaN. With a
    ``sigmoid_scale`` other than 0, the bias was ``sigmoid_scale * sigmoid(table[index])``
    (``relative_bias_gather``) and ``table`` (T, H) is that table."""
    heads = grad.shape[0]
    grad = grad.reshape(heads, -1)
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    out = grad.new_empty((num_rows, heads), dtype=dtype)
    block_h = _heads_block(heads)
    if INTERPRET:  # few programs: the interpreter's cost is per operation
        block_t, block_j = max(16, 1024 // block_h), 16
    else:
        # many programs, each taking its rows' pairs in one or a few latency-bound steps, at
        # most 4 * 256 * 16 values a step. H200, fp32 gradient (kernel alone, 2026-11-24),
        # BLOCK_J 64 -> 256, us: window 7 with 3 heads 2.30 -> 1.93, with 12 heads 3.76 ->
        # 2.79; window 8 2.37 -> 2.08; 12 (4 heads) 3.31 -> 2.37; 16 (3) 5.30 -> 2.60; 24 (4)
        # 9.13 -> 7.05; within 1.26x of the best of 48 (BLOCK_T, BLOCK_J, warps) everywhere.
        block_t, block_j = 4, min(256, max(32, 4096 // block_h))
    launcher(relative_bias_table_grad_kernel)[(-(-num_rows // block_t),)](
        grad, order, offsets, index.reshape(-1) if index is not None else order,
        table if sigmoid_scale else out, out, num_rows, grad.stride(0),
        *(table.stride() if sigmoid_scale else (0, 0)), *out.stride(),
        H=heads, BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_H=block_h, CHECK_INDEX=index is not None,
        SIGMOID_SCALE=float(sigmoid_scale), **compiler_options(),
    )
    return out


#: (rows, hidden units, warps) of the position-MLP kernels' programs. H100, best of 27 per
#: kernel on windows 8 and 24 with 3 and 32 heads (bench_position_mlp.py (removed at fc2fe00, in git) --sweep,
#: GPU us): the forward within 1.05x of the best but on window 24 with 3 heads (1.49x,
#: 22 us), 12 us on window 8 (21 us at (32, 64, 4)); the backward within 1.14x, 14 us on
#: window 8 (23 to 35 us at (32, 64, 4)). The interpreter: fewer, larger programs (it runs
#: them one after the other, paying Python per operation: 256 rows took SwinV2-CR's 2401-row
#: table forward and backward from 0.50 / 0.63 s at 64 rows to 0.15 / 0.26 s on a 2-core
#: CPU), still several hidden-unit blocks per program (K = 384, 512).
_MLP_FORWARD = (256, 128, 4) if INTERPRET else (16, 128, 2)
_MLP_BACKWARD = (256, 128, 4) if INTERPRET else (16, 32, 4)
#: rows that one backward program sums before it writes its partial sums: tables of up to
#: this many rows (windows up to 8x8) take one launch and no reduction. The interpreter's
#: programs sum two of their blocks, so that tables of over 512 rows still test both the
#: loop over a group's blocks and the sum of several groups' partial sums.
_MLP_ROWS_PER_PROGRAM = 512 if INTERPRET else 256
#: the kernels' heads block is at least this: tl.dot takes dims of 16 and more
_MLP_MIN_HEADS_BLOCK = 16


def position_mlp_table(coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                       b2: Optional[torch.Tensor] = None, dropout_mask: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, heads_first: bool = False) -> torch.Tensor:
    """dropout(relu(coords @ w1^T + b1)) @ w2^T + b2, fp32, from coords (T, 2), w1 (K, 2), b1
    (K,), w2 (H, K) and b2 (H,) or None, of any float dtypes and strides; the dropout where
    ``dropout_mask`` (T, K) is given: the hidden units where it is nonzero, times 1 / (1 -
    dropout_p). (T, H), or (H, T) where ``heads_first``."""
    num_rows, heads, hidden = coords.shape[0], w2.shape[0], w1.shape[0]
    out = coords.new_empty((heads, num_rows) if heads_first else (num_rows, heads), dtype=torch.float32)
    out_strides = out.stride()[::-1] if heads_first else out.stride()
    block_t, block_k, warps = _MLP_FORWARD
    block_h = _heads_block(heads, _MLP_MIN_HEADS_BLOCK)
    launcher(position_mlp_fwd_kernel)[(-(-num_rows // block_t),)](
        coords, w1, b1, w2, b2 if b2 is not None else w2, _keep(dropout_mask, w2), out, num_rows, hidden,
        _keep_scale(dropout_p), *coords.stride(), *w1.stride(), *w2.stride(), *_keep_strides(dropout_mask),
        *out_strides,
        H=heads, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_H=block_h, HAS_B2=b2 is not None,
        DROPOUT=dropout_mask is not None, **compiler_options(warps),
    )
    return out


def position_mlp_grads(grad: torch.Tensor, coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                       w2: torch.Tensor, b2: Optional[torch.Tensor] = None, dropout_mask: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """The gradients of ``position_mlp_table``'s weights given the gradient (T, H) of its
    output (any strides: the transpose of a heads-first table's), in one fp32 vector (3 K +
    H K (+ H),): dw1 (K, 2), db1 (K,), dw2 (H, K) and, where there is a b2, db2 (H,), one
    after the other, row-major (``split_position_mlp_grads``)."""
    num_rows, heads, hidden = coords.shape[0], w2.shape[0], w1.shape[0]
    block_t, block_k, warps = _MLP_BACKWARD
    block_h = _heads_block(heads, _MLP_MIN_HEADS_BLOCK)
    row_blocks = -(-num_rows // block_t)
    groups = -(-row_blocks // max(1, _MLP_ROWS_PER_PROGRAM // block_t))
    per_program = -(-row_blocks // groups)
    partials = coords.new_empty((groups, (3 + heads) * hidden + (heads if b2 is not None else 0)), dtype=torch.float32)
    launcher(position_mlp_bwd_kernel)[(groups, -(-hidden // block_k))](
        grad, coords, w1, b1, w2, _keep(dropout_mask, w2), partials, num_rows, hidden, per_program,
        _keep_scale(dropout_p), *grad.stride(), *coords.stride(), *w1.stride(), *w2.stride(),
        *_keep_strides(dropout_mask), partials.stride(0),
        H=heads, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_H=block_h, HAS_B2=b2 is not None,
        DROPOUT=dropout_mask is not None, **compiler_options(warps),
    )
    return partials.view(-1) if groups == 1 else partials.sum(0)


def _keep(dropout_mask: Optional[torch.Tensor], placeholder: torch.Tensor) -> torch.Tensor:
    """The dropout mask as the kernels read it (a bool mask as bytes), or a tensor they do
    not read."""
    if dropout_mask is None:
        return placeholder
    return dropout_mask.view(torch.uint8) if dropout_mask.dtype == torch.bool else dropout_mask


def _keep_strides(dropout_mask: Optional[torch.Tensor]) -> Tuple[int, int]:
    return dropout_mask.stride() if dropout_mask is not None else (0, 0)


def _keep_scale(dropout_p: float) -> float:
    return 1.0 / (1.0 - dropout_p)


def split_position_mlp_grads(sums: torch.Tensor, hidden: int, heads: int, has_b2: bool = False
                             ) -> Tuple[torch.Tensor, ...]:
    """(dw1 (K, 2), db1 (K,), dw2 (H, K)) and, ``has_b2``, db2 (H,): views of
    ``position_mlp_grads``'s vector."""
    dw1, db1 = sums[:2 * hidden].view(hidden, 2), sums[2 * hidden:3 * hidden]
    dw2 = sums[3 * hidden:(3 + heads) * hidden].view(heads, hidden)
    return (dw1, db1, dw2, sums[(3 + heads) * hidden:]) if has_b2 else (dw1, db1, dw2)
