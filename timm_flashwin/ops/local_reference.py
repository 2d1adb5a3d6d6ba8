"""The local-attention patterns written once in plain PyTorch: the oracle of the tests (run
it in float64) and the path ``sliding_window_attention`` and ``block_sliding_window_attention``
take where no Triton kernel runs (CPU tensors without ``TRITON_INTERPRET=1``, float64).

A pattern is the set of (query position i, key j) pairs that attend, stated here from the
API's definitions and nothing else (the kernels compute the same set from per-row key ranges,
``LocalPattern``; the tests check one against the other):

* sliding window ``(left, right)``: ``i - left <= j <= i + right``, ``None`` unlimited
  (FlashAttention-2's ``window_size``);
* block sliding window: key block ``j // block_size`` within ``window_blocks`` blocks of the
  query's, not after it (the published block sliding-window kernel's ``triu(1) + tril(-ws)`` over blocks), or
  ``j < sink_tokens``.

With S_q queries and S_k keys, query row r sits at position i = r + S_k - S_q
(FlashAttention-2's bottom-right alignment: the last query at the last key), which is
negative for the first rows where S_q > S_k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

#: rows, cols (int64 tensors broadcastable to each other) -> bool tensor: whether the query at
#: position ``rows`` attends key ``cols``
Visible = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: query rows, keys (int64 vectors) -> (B, H, len(rows), len(keys)): an additive bias of the logits
#: (``local.DecomposedBias.block``)
BiasBlock = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _every_pair(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """True for every (query position, key) pair of ``rows`` and ``cols`` broadcast (a query
    position may be negative: S_q > S_k), in their broadcast shape."""
    return (cols >= 0).expand(torch.broadcast_shapes(rows.shape, cols.shape))


def sliding_window_visible(left: Optional[int], right: Optional[int]) -> Visible:
    """Query i attends key j when ``i - left <= j <= i + right``; ``None`` is unlimited."""
    def visible(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        ok = _every_pair(rows, cols)
        if left is not None:
            ok = ok & (cols >= rows - left)
        if right is not None:
            ok = ok & (cols <= rows + right)
        return ok
    return visible


def block_window_visible(block_size: int, window_blocks: int, sink_tokens: int = 0) -> Visible:
    """A query of block b attends every key of blocks b - window_blocks + 1 ... b and the
    first ``sink_tokens`` keys."""
    def visible(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        query_block, key_block = rows // block_size, cols // block_size
        return ((key_block <= query_block) & (key_block > query_block - window_blocks)) | (cols < sink_tokens)
    return visible


@dataclass(frozen=True)
class LocalPattern:
    """Both patterns as the kernels compute them: with ``base(i) = (i // period) * period``
    (floor division), the query at position i attends the keys
    ``max(0, base(i) - before) <= j < min(S_k, base(i) + after)`` and the keys ``j < sink``.
    ``before`` / ``after`` of -1 are unlimited.

    Sliding window (left, right): period 1, before = left, after = right + 1.
    Block window: period = block_size, before = (window_blocks - 1) * block_size,
    after = block_size."""

    period: int
    before: int
    after: int
    sink: int = 0

    @staticmethod
    def sliding(left: Optional[int], right: Optional[int]) -> "LocalPattern":
        return LocalPattern(1, -1 if left is None else left, -1 if right is None else right + 1)

    @staticmethod
    def blocks(block_size: int, window_blocks: int, sink_tokens: int = 0) -> "LocalPattern":
        return LocalPattern(block_size, (window_blocks - 1) * block_size, block_size, sink_tokens)

    def visible(self) -> Visible:
        """The pattern pair by pair, elementwise only (FlexAttention's mask_mod takes it)."""
        def visible(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            base = rows // self.period * self.period
            ok = _every_pair(rows, cols)
            if self.before >= 0:
                ok = ok & (cols >= base - self.before)
            if self.after >= 0:
                ok = ok & (cols < base + self.after)
            return ok | (cols < self.sink)
        return visible


def local_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: Visible,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    dropout_factor: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
    bias: Optional[BiasBlock] = None,
) -> torch.Tensor:
    """``softmax(scale * q k^T + bias restricted to visible pairs) v``, differentiable.

    Args:
        q: (B, H, S_q, D); k, v: (B, H_kv, S_k, D) with H % H_kv == 0 (query head h reads
            key/value head h // (H // H_kv)).
        visible: the pattern (``sliding_window_visible``, ``block_window_visible``), which
            takes query row r at position r + S_k - S_q.
        scale: default D ** -0.5.
        dropout_p: ``F.dropout`` on the probabilities, when no ``dropout_factor`` is given.
        dropout_factor: (B, H, S_q, S_k) keep / (1 - p) to multiply the probabilities by (the
            kernels' own mask, ``kernels.local.launch.dropout_factors``).
        chunk: compute this many query rows at a time, each over the keys its rows can see
            only (memory O(S * (window + sink)) rather than O(S^2): long sequences on a GPU).
        bias: the logits' additive term, block by block (query rows, keys) -> (B, H, rows,
            keys), in any float dtype (computed in q's compute dtype); None: none.

    Returns:
        (B, H, S_q, D) in q's dtype; 16-bit inputs are computed in float32. A row that sees
        no key (a causal row before the first key, where S_q > S_k) is 0.
    """
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    B, H, S, D = q.shape
    S_k = k.shape[2]
    group = H // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    q, k, v = (t.to(compute) for t in (q, k, v))
    k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
    chunk = S if chunk is None else chunk
    cols = torch.arange(S_k, device=q.device)
    outs = []
    for start in range(0, S, chunk):
        rows = torch.arange(start, min(start + chunk, S), device=q.device)
        mask = visible(rows[:, None] + (S_k - S), cols[None, :])
        used = cols if chunk == S else mask.any(0).nonzero().squeeze(1)  # the keys some row sees
        mask = mask[:, used]
        scores = (q[:, :, rows] * scale) @ k[:, :, used].transpose(-2, -1)
        if bias is not None:
            scores = scores + bias(rows, used).to(compute)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        probs = torch.where(mask.any(-1, keepdim=True), probs, torch.zeros_like(probs))
        if dropout_factor is not None:
            probs = probs * dropout_factor[:, :, rows][..., used].to(compute)
        elif dropout_p > 0:
            probs = F.dropout(probs, dropout_p, training=True)
        outs.append(probs @ v[:, :, used])
    return torch.cat(outs, dim=2).to(dtype)
