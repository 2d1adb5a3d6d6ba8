"""Host side of the local-attention kernels: outputs allocated and kernels launched as a
call's plan (``local.plan.call_plan``) says.

Written with torch operations and ``launcher.launcher`` launches only, so that
``torch.library.triton_op`` traces them under torch.compile.

A tensor a kernel writes goes to its launch under one parameter only, and an unused pointer
(the tile counts, outside tests) is None, never another argument. A traced launch is a
functional op that clones each argument the kernel may write and hands each clone back in
its argument's place; torch's analysis of the kernel counts every argument of a Triton
function whose results address a store as written. lse passed again as the forward's unused
tile counts came back as its never-written clone (opcheck's test_aot_dispatch_dynamic:
the outputs of eager mode and AOTDispatcher differed). Where a tensor is needed for an unused
pointer (the seed without dropout), ``launcher.unused_pointer`` gives it: q in a direct
launch, an empty tensor of its own in a traced one; the bias's pointers without a bias are
None too.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..arch import tensor_arch
from ..launcher import compiler_options, launcher, traced_launch, unused_pointer
from .backward import local_attention_bwd_dkdv_kernel, local_attention_bwd_dq_kernel
from .bias import DECOMPOSED, NO_BIAS
from .forward import local_attention_fwd_kernel, local_dropout_factor_kernel
from .plan import LocalCall, Pattern, call_plan
from ..sizes import cdiv

LOG2E = 1.0 / math.log(2.0)


class LocalInputs(NamedTuple):
    """One call's tensors: q (B, H, S_q, D), k and v (B, H_kv, S_k, D), the dropout seed (a
    one-element int64 tensor, or None), and a decomposed bias's rel_h (B, H, S_q, key_h) and
    rel_w (B, H, S_q, key_w), contiguous (their gradients take their strides), or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seed: Optional[torch.Tensor] = None
    rel_h: Optional[torch.Tensor] = None
    rel_w: Optional[torch.Tensor] = None


class LocalGrads(NamedTuple):
    """The backward's gradients: of q, k, v (their layouts) and of rel_h, rel_w (None
    without a bias)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    d_rel_h: Optional[torch.Tensor] = None
    d_rel_w: Optional[torch.Tensor] = None


def local_call(inputs: LocalInputs, pattern: Pattern, scale: float, dropout_p: float,
               key_w: int = 0) -> LocalCall:
    """The ``LocalCall`` of validated inputs: a decomposed bias where ``inputs.rel_h`` is
    given, over a key grid of ``key_w`` columns."""
    q, k = inputs.q, inputs.k
    # concrete sizes: the call keys the plan cache, and the SymInts of torch.library's tracing
    # (a triton_op's functional decomposition under dynamic shapes) cannot be hashed
    batch, heads, queries, head_dim = (int(n) for n in q.shape)
    keys, key_w = int(k.shape[2]), int(key_w)
    biased = inputs.rel_h is not None
    return LocalCall(batch, heads, int(k.shape[1]), queries, keys, head_dim, q.dtype, tensor_arch(q),
                     tuple(int(n) for n in pattern), bool(dropout_p > 0), bool(scale > 0),
                     DECOMPOSED if biased else NO_BIAS, keys // key_w if biased else 0, key_w if biased else 0)


_NO_BIAS_STRIDES = (0,) * 8


def _bias_strides(inputs: LocalInputs) -> Tuple[int, ...]:
    """rel_h's and rel_w's strides as the kernels take them (``local.bias``), zeros without."""
    if inputs.rel_h is None:
        return _NO_BIAS_STRIDES
    return (*inputs.rel_h.stride(), *inputs.rel_w.stride())


def local_forward(call: LocalCall, inputs: LocalInputs, scale: float, dropout_p: float = 0.0,
                  counts: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, S_q, D) in q's dtype and layout (``torch.empty_like``), and lse (B, H, S_q)
    fp32 (each row's log2-sum-exp), for ``call`` (``local_call``) on validated ``inputs``
    (query i at key position i + S_k - S_q, ``local.tiles``). ``counts``: tests only, an
    int32 (2,) tensor to which the tiles visited without and with a mask are added."""
    q, k, v = inputs.q, inputs.k, inputs.v
    fwd = call_plan(call, counts is not None).fwd
    out = torch.empty_like(q)
    lse = q.new_empty((call.batch, call.heads, call.queries), dtype=torch.float32)
    seed = inputs.seed if dropout_p > 0 else unused_pointer(q, traced_launch())
    bias_strides = _bias_strides(inputs)
    launcher(local_attention_fwd_kernel)[fwd.grid](
        q, k, v, out, lse, seed, counts, inputs.rel_h, inputs.rel_w,
        scale * LOG2E, dropout_p, call.queries, call.keys, call.heads, call.heads // call.kv_heads, *call.pattern,
        max(call.key_w, 1), *q.stride(), *k.stride(), *v.stride(), *out.stride(), *bias_strides, **fwd.kwargs,
    )
    return out, lse


def local_backward(call: LocalCall, inputs: LocalInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   scale: float, dropout_p: float = 0.0, counts: Optional[torch.Tensor] = None) -> LocalGrads:
    """The gradients (``LocalGrads``, in the layouts of q, k, v and the bias's tensors) from
    the forward's inputs, out and lse (the same seed); dout any strides. ``counts``: tests
    only, (4,) int32: the dkdv kernel's tiles without and with a mask, then the dq kernel's."""
    q, k, v = inputs.q, inputs.k, inputs.v
    plan = call_plan(call, counts is not None)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = q.new_empty((call.batch, call.heads, call.queries), dtype=torch.float32)
    seed = inputs.seed if dropout_p > 0 else unused_pointer(q, traced_launch())
    rel_h, rel_w = inputs.rel_h, inputs.rel_w
    bias_strides = _bias_strides(inputs)
    # the kernels write the gradients with rel_h's and rel_w's strides (contiguous: LocalInputs)
    d_rel_h, d_rel_w = (torch.empty_like(rel_h), torch.empty_like(rel_w)) if rel_h is not None else (None, None)
    numbers = (scale * LOG2E, scale, dropout_p, call.queries, call.keys)
    group = call.heads // call.kv_heads
    # dq first: it also stores each row's delta, which the dkdv kernel reads
    launcher(local_attention_bwd_dq_kernel)[plan.dq.grid](
        q, k, v, out, dout, lse, delta, dq, seed, counts[2:] if counts is not None else None,
        rel_h, rel_w, d_rel_h, d_rel_w, *numbers, call.heads, group, *call.pattern, max(call.key_w, 1),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *dout.stride(), *dq.stride(), *bias_strides,
        **plan.dq.kwargs,
    )
    launcher(local_attention_bwd_dkdv_kernel)[plan.dkdv.grid](
        q, k, v, dout, lse, delta, dk, dv, seed, counts, rel_h, rel_w,
        *numbers, call.kv_heads, group, *call.pattern, max(call.key_w, 1),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(), *bias_strides,
        **plan.dkdv.kwargs,
    )
    return LocalGrads(dq, dk, dv, d_rel_h, d_rel_w)


def dropout_factors(seed: torch.Tensor, batch: int, heads: int, queries: int, dropout_p: float,
                    keys: Optional[int] = None) -> torch.Tensor:
    """Tests only: (B, H, S_q, S_k) fp32 (S_k = S_q unless ``keys``), keep / (1 - p) where the
    kernels keep a probability and 0 where they drop it, for the one-element int64 ``seed``
    the op drew."""
    keys = queries if keys is None else keys
    out = torch.empty((batch, heads, queries, keys), dtype=torch.float32, device=seed.device)
    block = 32
    launcher(local_dropout_factor_kernel)[(batch * heads, cdiv(queries, block), cdiv(keys, block))](
        seed, out, dropout_p, queries, keys, BLOCK=block, **compiler_options())
    return out
