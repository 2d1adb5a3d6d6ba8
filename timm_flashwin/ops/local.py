"""The local-attention operators: ``sliding_window_attention`` (1-D sliding window, causal,
global) and ``block_sliding_window_attention`` (blocks of tokens, a window of blocks,
attention sinks), with PyTorch's scaled_dot_product_attention conventions.

Both are one pattern to the kernels (``local_reference.LocalPattern``) and one pair of
registered operators (``local_operators``), ``timm_flashwin::local_attention_fwd`` /
``local_attention_bwd``, whose autograd formula torch.compile traces. In eager mode on plain
tensors the same kernels launch without the operator dispatch (``dispatch.dispatch_free``),
as ``window_attention`` does; where no kernel runs (plain CPU tensors, float64) PyTorch
computes ``local_reference``'s math, with the same semantics. ``attend`` is the road all of
them take, also the decomposed relative-position attention (``rel_pos``), a bias of the
same kernels.
"""
from __future__ import annotations

from numbers import Real
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import host_program
from .dispatch import KERNEL_DTYPES, call_operator, dispatch_free, served, uses_kernels
from ..kernels.arch import tensor_arch
from ..kernels.local.launch import LocalInputs
from ..kernels.local.plan import bias_fits, fits
from .local_operators import (EagerLocalAttention, LocalArgs, forward_without_grad, host_inputs,
                              local_attention_fwd, operator_inputs)
from .local_reference import (LocalPattern, Visible, block_window_visible, local_attention_reference,
                              sliding_window_visible)
from .dropout_seed import draw_dropout_seed

#: the longest sequence and the largest head_dim the kernels take
MAX_TOKENS = 1 << 20
MAX_HEAD_DIM = 256
#: window sizes beyond this are unlimited to the kernels (they clamp every bound to S)
_UNLIMITED = 1 << 30
#: query rows the PyTorch path (float64, plain CPU tensors) computes at a time, each chunk
#: over the keys its rows see: memory O(S * visible keys per row), not O(S^2)
REFERENCE_CHUNK = 1024


# --------------------------------------------------------------------------- the roads
def _eager_call(inputs: LocalInputs, args: LocalArgs, grad: bool) -> torch.Tensor:
    """The eager forward: where a gradient follows, ``EagerLocalAttention``, else the forward
    alone; on CUDA either one's host program replayed (``host_program``: recorded on the
    signature's first call)."""
    if grad:
        python_road = lambda: EagerLocalAttention.apply(inputs.q, inputs.k, inputs.v, inputs.rel_h,  # noqa: E731
                                                         inputs.rel_w, inputs.seed, args)[0]
    else:
        python_road = lambda: forward_without_grad(inputs, args)  # noqa: E731
    if not host_program.takes(inputs.q):
        return python_road()
    tensors = host_inputs(inputs)
    key = ("local", *map(host_program.tensor_key, tensors), args, host_program.settings_key())
    return host_program.call(key, tensors, python_road, grad=grad)


def _served(q: torch.Tensor, bias: Optional["DecomposedBias"]) -> bool:
    """Whether the kernels serve ``q``'s device and dtype at its head_dim and, with a bias,
    its key grid (``dispatch.served``)."""
    arch, head_dim = tensor_arch(q), q.shape[-1]

    def misfit() -> Optional[str]:
        if not fits(head_dim, q.dtype, arch):
            return f"head_dim {head_dim}"
        if bias is not None and not bias_fits(bias.key_h, bias.key_w):
            return f"a decomposed bias over a {bias.key_h} x {bias.key_w} key grid"
        return None
    return served(arch, q.dtype, misfit)


class DecomposedBias(NamedTuple):
    """A decomposed relative-position bias as the local kernels take it (``local.bias``):
    rel_h (B, H, S_q, key_h), rel_w (B, H, S_q, key_w), key j on grid row j // key_w."""

    rel_h: torch.Tensor
    rel_w: torch.Tensor
    key_h: int
    key_w: int

    def block(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(B, H, len(rows), len(cols)): the bias of queries ``rows`` and keys ``cols`` (int64
        vectors) as a tensor (the PyTorch road's, a block of rows at a time)."""
        rel_h, rel_w = self.rel_h[:, :, rows], self.rel_w[:, :, rows]
        return rel_h[..., cols // self.key_w] + rel_w[..., cols % self.key_w]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: LocalPattern, visible: Visible,
           scale: float, dropout_p: float, bias: Optional[DecomposedBias] = None) -> torch.Tensor:
    """The attention of validated inputs on its road: PyTorch's math (``local_reference``)
    where no kernel serves them, the registered operators under torch.compile, a dispatch
    mode or tensor subclasses, else the kernels launched here (``_eager_call``)."""
    kernels = uses_kernels(q) and _served(q, bias)
    if not kernels or q.numel() == 0:
        chunk = REFERENCE_CHUNK if q.shape[2] > REFERENCE_CHUNK else None
        return local_attention_reference(q, k, v, visible, scale, dropout_p, chunk=chunk,
                                         bias=bias.block if bias is not None else None)
    seed = draw_dropout_seed(q.device) if dropout_p > 0 else None
    rel_h, rel_w = (bias.rel_h.contiguous(), bias.rel_w.contiguous()) if bias is not None else (None, None)
    inputs = LocalInputs(q, k, v, seed, rel_h, rel_w)
    args = LocalArgs((pattern.period, pattern.before, pattern.after, pattern.sink), scale, dropout_p,
                     bias.key_w if bias is not None else 0)
    if not all(dispatch_free(t) for t in host_inputs(inputs)):
        return call_operator(local_attention_fwd, *operator_inputs(inputs, args))[0]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, rel_h, rel_w) if t is not None)
    return _eager_call(inputs, args, grad)


# --------------------------------------------------------------------------- validation
def fail(exc, function: str, argument: str, expected: str, got) -> None:
    raise exc(f"{function}: `{argument}` must be {expected}, got {got}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_inputs(function: str, q, k, v) -> Tuple[int, int, int, int]:
    """(B, H, S_q, D) of valid q (B, H, S_q, D), k and v (B, H_kv, S_k, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, function, name, "a torch.Tensor", type(t).__name__)
        if t.dim() != 4:
            fail(ValueError, function, name, "a 4-D tensor (B, H, S, D)", f"shape {tuple(t.shape)}")
    if q.dtype not in KERNEL_DTYPES + (torch.float64,):
        fail(TypeError, function, "q", "float16, bfloat16, float32 or float64", q.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(TypeError, function, name, f"of q's dtype {q.dtype}", t.dtype)
        if t.device != q.device:
            fail(ValueError, function, name, f"on q's device {q.device}", t.device)
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        fail(ValueError, function, "k", f"of shape (B, H_kv, S_k, D) = ({B}, H_kv, S_k, {D})",
              f"shape {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        fail(ValueError, function, "k", f"a head count H_kv dividing q's H = {H}", k.shape[1])
    if v.shape != k.shape:
        fail(ValueError, function, "v", f"of k's shape {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    if not 1 <= S <= MAX_TOKENS:
        fail(ValueError, function, "q", f"a sequence length S_q in [1, {MAX_TOKENS}]", S)
    if not 1 <= k.shape[2] <= MAX_TOKENS:
        fail(ValueError, function, "k", f"a sequence length S_k in [1, {MAX_TOKENS}]", k.shape[2])
    if not 1 <= D <= MAX_HEAD_DIM:
        fail(ValueError, function, "q", f"a head_dim D in [1, {MAX_HEAD_DIM}]", D)
    return B, H, S, D


def check_scale(function: str, scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, Real):
        fail(TypeError, function, "scale", "a Python float or None", type(scale).__name__)
    if not abs(float(scale)) < float("inf"):
        fail(ValueError, function, "scale", "finite", scale)
    return float(scale)


def check_dropout(function: str, dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real) or not 0.0 <= dropout_p < 1.0:
        fail(ValueError, function, "dropout_p", "a float in [0, 1)", repr(dropout_p))
    return float(dropout_p)


def _check_count(function: str, name: str, value, least: int) -> int:
    if not _is_int(value):
        fail(TypeError, function, name, "an int", type(value).__name__)
    if value < least:
        fail(ValueError, function, name, f"at least {least}", value)
    return min(value, _UNLIMITED)


def _check_window(function: str, window) -> Tuple[Optional[int], Optional[int]]:
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        fail(TypeError, function, "window", "a pair (left, right) of ints >= 0 or None", repr(window))
    sides = []
    for name, side in zip(("window[0] (left)", "window[1] (right)"), window):
        if side is None:
            sides.append(None)
        elif not _is_int(side):
            fail(TypeError, function, name, "an int or None", type(side).__name__)
        elif side < 0:
            fail(ValueError, function, name, ">= 0 (a negative side would leave queries with no key; None is "
                                              "unlimited)", side)
        else:
            sides.append(min(side, _UNLIMITED - 1))
    return sides[0], sides[1]


# --------------------------------------------------------------------------- public ops
def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: Tuple[Optional[int], Optional[int]] = (None, None),
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Sliding-window attention: query i attends key j when ``i - left <= j <= i + right``.

    With S_q queries and S_k keys, query row r is at position i = r + S_k - S_q
    (FlashAttention-2's bottom-right alignment: the last query sits at the last key, as a
    decoder's new tokens after its cached ones); where S_q > S_k the first rows' positions are
    negative, and a causal row that sees no key gives 0.

    ``window=(left, right)`` as FlashAttention-2's ``window_size``: ``None`` for a side is
    unlimited, so ``(None, None)`` is global attention; ``causal=True`` sets ``right`` to 0
    (``(None, 0)``: causal attention; ``(left, 0)``: causal with a window of ``left``
    earlier tokens). Both sides count tokens besides the query itself, which is always seen.

    A total window width w (w keys per query, centred, as the published kernels' WINDOW_SIZE)
    is ``right = (w - 1) // 2``, ``left = w - 1 - right``. For w = 4: window=(2, 1), and
    with S = 6 query 3 sees keys 1, 2, 3, 4, query 0 keys 0, 1 (rows cut at the ends)::

        >>> out = sliding_window_attention(q, k, v, window=(2, 1))          # w = 4
        >>> out = sliding_window_attention(q, k, v, window=(500, 0), causal=True)
        >>> # key j seen by query i:   j = 0 1 2 3 4 5
        >>> # window=(2, 1), i = 3:        . x x x x .

    Args:
        q: (B, H, S_q, D), float16 / bfloat16 / float32 (float64 runs in PyTorch); any strides.
        k, v: (B, H_kv, S_k, D), q's dtype and device, H % H_kv == 0 (grouped-query and
            multi-query attention: query head h reads key/value head h // (H // H_kv)).
            S_q and S_k in [1, 2^20], D in [1, 256].
        window: (left, right), ints >= 0 or None.
        causal: right = 0.
        scale: the logits' factor, default D ** -0.5.
        dropout_p: dropout on the attention probabilities, scaled by 1 / (1 - p) as
            F.scaled_dot_product_attention applies it (pass 0 in eval mode). The kernels draw
            the mask from a seed taken from torch's generator and regenerate it in the
            backward; PyTorch's path applies F.dropout.

    Returns:
        (B, H, S_q, D) in q's dtype (and, on the kernels' path, q's memory layout).
    """
    function = "sliding_window_attention"
    _, _, _, D = check_inputs(function, q, k, v)
    left, right = _check_window(function, window)
    if not isinstance(causal, bool):
        fail(TypeError, function, "causal", "a bool", type(causal).__name__)
    if causal:
        right = 0
    scale = check_scale(function, scale, D)
    dropout_p = check_dropout(function, dropout_p)
    return attend(q, k, v, LocalPattern.sliding(left, right), sliding_window_visible(left, right), scale, dropout_p)


def block_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    window_blocks: int,
    sink_tokens: int = 0,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Block sliding-window attention (autoregressive video: a block is a frame).

    Tokens form consecutive blocks of ``block_size`` (the last may be partial). A query in
    block b attends every key of blocks ``b - window_blocks + 1 ... b`` (its own block in
    full, and no later block), plus the first ``sink_tokens`` tokens of the sequence
    (attention sinks, seen by every query). Blocks are counted in key positions: with S_q
    queries and S_k keys query row r is at position r + S_k - S_q (``sliding_window_attention``),
    e.g. the tokens of the newest frames against a cache of all the frames' keys.
    With block_size=2, window_blocks=2, S=7::

        >>> out = block_sliding_window_attention(q, k, v, block_size=2, window_blocks=2)
        >>> # query 5 (block 2) sees keys 2, 3, 4, 5 (blocks 1 and 2); query 6 (block 3) keys 4, 5, 6

    Args:
        q, k, v, scale, dropout_p: as ``sliding_window_attention``'s.
        block_size: tokens per block, >= 1 (any S: not a multiple needed).
        window_blocks: blocks seen, the query's own included, >= 1.
        sink_tokens: >= 0.

    Returns:
        (B, H, S_q, D) in q's dtype.
    """
    function = "block_sliding_window_attention"
    _, _, _, D = check_inputs(function, q, k, v)
    block_size = _check_count(function, "block_size", block_size, 1)
    window_blocks = _check_count(function, "window_blocks", window_blocks, 1)
    sink_tokens = _check_count(function, "sink_tokens", sink_tokens, 0)
    scale = check_scale(function, scale, D)
    dropout_p = check_dropout(function, dropout_p)
    pattern = LocalPattern.blocks(block_size, window_blocks, sink_tokens)
    pattern = LocalPattern(pattern.period, min(pattern.before, _UNLIMITED), pattern.after, pattern.sink)
    return attend(q, k, v, pattern, block_window_visible(block_size, window_blocks, sink_tokens), scale, dropout_p)
