"""Attention with a decomposed relative-position bias (MViTv2's, which SAM's image encoder,
ViTDet and their forks use), fused: ``decomposed_attention`` takes the bias's two terms,
``rel_pos_terms`` computes them from a model's tables as those models do.

For a query at (h_i, w_i) and a key at (h_j, w_j) of a key grid (key_h, key_w):
``bias[i, j] = q_i . Rh[h_i, h_j] + q_i . Rw[w_i, w_j]``, q unscaled, Rh and Rw the tables as
``get_rel_pos`` gathers (and interpolates) them. So ``rel_h = q Rh^T`` (S_q x key_h) and
``rel_w = q Rw^T`` (S_q x key_w) and ``bias[i, j] = rel_h[i, j // key_w] + rel_w[i, j % key_w]``:
the kernels add it as they go (``kernels.local.bias``), never an S_q x S_k tensor, and give
rel_h's and rel_w's gradients beside dq, dk, dv; PyTorch's autograd takes them on to q and
the tables through ``rel_pos_terms``.
"""
from __future__ import annotations

from numbers import Integral
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .dispatch import no_dispatch_mode
from .local import DecomposedBias, attend, check_dropout, check_inputs, check_scale, fail
from .local_reference import LocalPattern, sliding_window_visible

_GLOBAL = LocalPattern.sliding(None, None)
_SEES_ALL = sliding_window_visible(None, None)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def decomposed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: torch.Tensor,
    rel_w: torch.Tensor,
    *,
    key_size: Tuple[int, int],
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Global attention with a decomposed relative-position bias, fused forward and backward.

    ``out = dropout(softmax(scale * q k^T + B)) v`` with
    ``B[b, h, i, j] = rel_h[b, h, i, j // key_w] + rel_w[b, h, i, j % key_w]``: the keys are
    the (key_h, key_w) grid's tokens in row-major order. What SAM's ``Attention`` computes
    with ``get_decomposed_rel_pos_bias`` (``rel_pos_terms`` gives rel_h and rel_w from its
    tables) and hands SDPA as a dense (B*heads, S_q, S_k) mask, without that mask::

        >>> rel_h, rel_w = rel_pos_terms(q, Rh, Rw, q_size=(64, 64))
        >>> out = decomposed_attention(q, k, v, rel_h, rel_w, key_size=(64, 64))

    Args:
        q: (B, H, S_q, D), float16 / bfloat16 / float32 (float64 runs in PyTorch); any strides.
        k, v: (B, H_kv, S_k, D), q's dtype and device, H % H_kv == 0; S_k = key_h * key_w.
        rel_h: (B, H, S_q, key_h), any float dtype (read as float32), q's device.
        rel_w: (B, H, S_q, key_w), likewise. Both get gradients.
        key_size: (key_h, key_w), the keys' grid.
        scale: the logits' factor (not the bias's), default D ** -0.5.
        dropout_p: dropout on the probabilities, as ``sliding_window_attention``'s.

    Returns:
        (B, H, S_q, D) in q's dtype.
    """
    function = "decomposed_attention"
    B, H, S_q, D = check_inputs(function, q, k, v)
    key_h, key_w = _check_size(function, "key_size", key_size)
    if key_h * key_w != k.shape[2]:
        fail(ValueError, function, "key_size", f"a grid of S_k = {k.shape[2]} keys (key_h * key_w)",
             f"{key_h} x {key_w} = {key_h * key_w}")
    for name, t, side in (("rel_h", rel_h, key_h), ("rel_w", rel_w, key_w)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, function, name, "a torch.Tensor", type(t).__name__)
        if tuple(t.shape) != (B, H, S_q, side):
            fail(ValueError, function, name, f"of shape (B, H, S_q, {name[-1]}) = {(B, H, S_q, side)}",
                 f"shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            fail(TypeError, function, name, "a float tensor", t.dtype)
        if t.device != q.device:
            fail(ValueError, function, name, f"on q's device {q.device}", t.device)
    scale = check_scale(function, scale, D)
    dropout_p = check_dropout(function, dropout_p)
    return attend(q, k, v, _GLOBAL, _SEES_ALL, scale, dropout_p, DecomposedBias(rel_h, rel_w, key_h, key_w))


def rel_pos_terms(q: torch.Tensor, rel_h_table: torch.Tensor, rel_w_table: torch.Tensor,
                  q_size: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rel_h, rel_w) of ``decomposed_attention`` from q (B, H, q_h * q_w, D) and the gathered
    tables ``rel_h_table`` (q_h, key_h, D) and ``rel_w_table`` (q_w, key_w, D) (SAM's
    ``get_rel_pos(q_h, k_h, rel_pos_h)``): rel_h[b, h, i, r] = q[b, h, i] . rel_h_table[i // q_w, r],
    rel_w[b, h, i, c] = q[b, h, i] . rel_w_table[i % q_w, c]; (B, H, q_h * q_w, key_h) and
    (..., key_w), in the dtype PyTorch's einsum gives (q's, or autocast's), as SAM computes
    them; differentiable."""
    q_h, q_w = q_size
    B, H, S, D = q.shape
    grid_q = q.reshape(B, H, q_h, q_w, D)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid_q, rel_h_table)
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid_q, rel_w_table)
    return rel_h.reshape(B, H, S, rel_h_table.shape[1]), rel_w.reshape(B, H, S, rel_w_table.shape[1])


def rel_pos_table_terms(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor, q_size: Tuple[int, int],
                        interpolate_always: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rel_h, rel_w) of ``decomposed_attention`` over keys on q's own grid, from a model's
    tables (SAM's ``rel_pos_h`` (L_h, D) and ``rel_pos_w`` (L_w, D)): the values of
    ``rel_pos_terms(q, gathered_table(rel_pos_h, q_h, q_h), gathered_table(rel_pos_w, q_w, q_w),
    q_size)``, tables interpolated as there, differentiable, in the dtype a matmul of q and the
    tables gives (autocast's too).

    Computed as one product of q with both tables' 2 q_h - 1 and 2 q_w - 1 rows, each query's
    terms then gathered from its row of the product (its grid row's and column's offsets):
    the einsums of ``rel_pos_terms`` (SAM's) batch over the grid's rows with q permuted to
    that order, which took cuBLAS 0.41 ms for the two on SAM's 14 x 14 windows (H200, bf16,
    100 windows x 12 heads: small-tile GEMMs of 16800 x 64 x 14), 2.9x the fused forward
    kernel's 0.14 ms.

    Args:
        q: (B, H, q_h * q_w, D), any strides.
        rel_pos_h, rel_pos_w: (L, D) each, the model's tables.
        q_size: (q_h, q_w), the queries' (and keys') grid.
        interpolate_always: as ``gathered_table``'s (transformers' SAM; the same values).

    Returns:
        rel_h (B, H, q_h * q_w, q_h) and rel_w (B, H, q_h * q_w, q_w), contiguous.
    """
    q_h, q_w = q_size
    B, H, S, _ = q.shape
    tables = torch.cat((_resized(rel_pos_h, 2 * q_h - 1, interpolate_always),
                        _resized(rel_pos_w, 2 * q_w - 1, interpolate_always)))
    products = torch.matmul(q, tables.t())  # (B, H, S, 2 q_h - 1 + 2 q_w - 1)
    index_h, index_w = _query_index(q_h, q_w, q.device)
    return products.gather(3, index_h.expand(B, H, S, q_h)), products.gather(3, index_w.expand(B, H, S, q_w))


def gathered_table(rel_pos: torch.Tensor, q_size: int, k_size: int, interpolate_always: bool = False
                   ) -> torch.Tensor:
    """SAM's ``get_rel_pos(q_size, k_size, rel_pos)``: (q_size, k_size, D), row i, column j the
    table's row for query i and key j: the table (L, D) linearly interpolated to
    2 max(q_size, k_size) - 1 rows where it has another number (transformers' SAM interpolates
    always: ``interpolate_always``, the same values), the coordinates of the shorter side
    scaled. The same values and gradient as timm's and transformers' functions, without their
    host-to-device copy of the index in every call (a synchronization: the host waits for the
    GPU there, twice per attention module): the index is kept per (sizes, device) in eager mode."""
    rel_pos = _resized(rel_pos, int(2 * max(q_size, k_size) - 1), interpolate_always)
    return rel_pos[_relative_index(q_size, k_size, rel_pos.device)]


def _resized(rel_pos: torch.Tensor, rows: int, always: bool) -> torch.Tensor:
    """The table (L, D) linearly interpolated to ``rows`` rows, as SAM's ``get_rel_pos``
    does where L differs (or ``always``)."""
    if always or rel_pos.shape[0] != rows:
        resized = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1), size=rows, mode="linear")
        rel_pos = resized.reshape(-1, rows).permute(1, 0)
    return rel_pos


#: (q_size, k_size, device) -> the (q_size, k_size) int64 index of ``gathered_table``
_INDEX: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}


def _relative_index(q_size: int, k_size: int, device: torch.device) -> torch.Tensor:
    """The models' index, computed as they compute it (float32 coordinates, truncated)."""
    key = (q_size, k_size, device)
    index = _INDEX.get(key)
    if index is None:
        q_coords = torch.arange(q_size, dtype=torch.float32)[:, None] * max(k_size / q_size, 1.0)
        k_coords = torch.arange(k_size, dtype=torch.float32)[None, :] * max(q_size / k_size, 1.0)
        index = ((q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)).long().to(device)
        if no_dispatch_mode():  # a tensor made while tracing (torch.compile) is not kept for later calls
            _INDEX[key] = index
    return index


#: (q_h, q_w, device) -> ``rel_pos_table_terms``' (S, q_h) and (S, q_w) int64 indices
_QUERY_INDEX: Dict[Tuple[int, int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}


def _query_index(q_h: int, q_w: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """For query n (grid row n // q_w, column n % q_w), the columns of ``rel_pos_table_terms``'
    product holding its rel_h and rel_w: its grid row's row of ``_relative_index(q_h, q_h)``,
    and its column's of ``_relative_index(q_w, q_w)`` past the 2 q_h - 1 rows of rel_pos_h."""
    key = (q_h, q_w, device)
    found = _QUERY_INDEX.get(key)
    if found is None:
        queries = torch.arange(q_h * q_w)
        index_h = _relative_index(q_h, q_h, torch.device("cpu"))[queries // q_w]
        index_w = _relative_index(q_w, q_w, torch.device("cpu"))[queries % q_w] + (2 * q_h - 1)
        found = (index_h.to(device), index_w.to(device))
        if no_dispatch_mode():  # a tensor made while tracing (torch.compile) is not kept for later calls
            _QUERY_INDEX[key] = found
    return found


def _check_size(function: str, name: str, size: Sequence[int]) -> Tuple[int, int]:
    if (not isinstance(size, Sequence) or isinstance(size, str) or len(size) != 2
            or not all(isinstance(s, Integral) and not isinstance(s, bool) and s >= 1 for s in size)):
        fail(TypeError, function, name, "a pair (height, width) of ints >= 1", repr(size))
    return int(size[0]), int(size[1])
