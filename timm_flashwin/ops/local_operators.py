"""The local-attention operators registered with torch.library, and the autograd both roads
share: ``timm_flashwin::local_attention_fwd`` / ``local_attention_bwd``, whose autograd formula
torch.compile traces, and ``EagerLocalAttention``, the same forward and backward launched
without the operator dispatch (eager mode on plain tensors).

The one place a call is converted to and from the operators' flat schemas: a call is its
tensors (``LocalInputs``) and its numbers (``LocalArgs``); what the forward saves is a
``LocalSaved``, read by name.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import host_program
from .dispatch import call_operator, direct_launches, register_autograd, register_op
from ..kernels.local.launch import LocalGrads, LocalInputs, local_backward, local_call, local_forward
from ..kernels.local.plan import Pattern


class LocalArgs(NamedTuple):
    """A call's numbers: the pattern (period, before, after, sink), the logits' scale, the
    dropout probability, and the key grid's width of a decomposed bias (0: none)."""

    pattern: Pattern
    scale: float
    dropout_p: float
    key_w: int = 0


class LocalSaved(NamedTuple):
    """What the forward keeps for the backward: its inputs, out and lse."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seed: Optional[torch.Tensor]
    rel_h: Optional[torch.Tensor]
    rel_w: Optional[torch.Tensor]
    out: torch.Tensor
    lse: torch.Tensor

    def inputs(self) -> LocalInputs:
        return LocalInputs(self.q, self.k, self.v, self.seed, self.rel_h, self.rel_w)


def forward(inputs: LocalInputs, args: LocalArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one call, launched here (``local.launch.local_forward``)."""
    call = local_call(inputs, args.pattern, args.scale, args.dropout_p, args.key_w)
    return local_forward(call, inputs, args.scale, args.dropout_p)


def backward(saved: LocalSaved, args: LocalArgs, grad_out: torch.Tensor) -> LocalGrads:
    """The gradients of one call from what its forward saved, launched here."""
    inputs = saved.inputs()
    call = local_call(inputs, args.pattern, args.scale, args.dropout_p, args.key_w)
    return local_backward(call, inputs, saved.out, saved.lse, grad_out, args.scale, args.dropout_p)


# --------------------------------------------------------------------------- flat schemas
def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, period: int, before: int, after: int,
                  sink: int, scale: float, dropout_p: float, seed: Optional[torch.Tensor],
                  rel_h: Optional[torch.Tensor] = None, rel_w: Optional[torch.Tensor] = None, key_w: int = 0
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    return forward(LocalInputs(q, k, v, seed, rel_h, rel_w), LocalArgs((period, before, after, sink), scale,
                                                                      dropout_p, key_w))


def _forward_fake(q, k, v, period, before, after, sink, scale, dropout_p, seed, rel_h=None, rel_w=None, key_w=0):
    B, H, S, _ = q.shape  # S: the queries
    return torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)


def _backward_impl(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, period: int, before: int, after: int, sink: int, scale: float,
                   dropout_p: float, seed: Optional[torch.Tensor], rel_h: Optional[torch.Tensor] = None,
                   rel_w: Optional[torch.Tensor] = None, key_w: int = 0
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d rel_h, d rel_w), the last two empty without a bias (an operator's
    outputs are tensors)."""
    grads = backward(LocalSaved(q, k, v, seed, rel_h, rel_w, out, lse),
                     LocalArgs((period, before, after, sink), scale, dropout_p, key_w), grad_out)
    if rel_h is None:
        return grads.dq, grads.dk, grads.dv, q.new_empty((0,)), q.new_empty((0,))
    return tuple(grads)


def _backward_fake(grad_out, q, k, v, out, lse, period, before, after, sink, scale, dropout_p, seed, rel_h=None,
                   rel_w=None, key_w=0):
    if rel_h is None:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty((0,)), q.new_empty((0,))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(rel_h),
            torch.empty_like(rel_w))


local_attention_fwd = register_op("local_attention_fwd", _forward_impl, _forward_fake)
local_attention_bwd = register_op("local_attention_bwd", _backward_impl, _backward_fake)


def operator_inputs(inputs: LocalInputs, args: LocalArgs) -> tuple:
    """``local_attention_fwd``'s flat arguments for a call."""
    return (inputs.q, inputs.k, inputs.v, *args.pattern, args.scale, args.dropout_p, inputs.seed, inputs.rel_h,
            inputs.rel_w, args.key_w)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, period, before, after, sink, scale, dropout_p, seed, rel_h, rel_w, key_w = inputs
    out, lse = output
    _save(ctx, LocalSaved(q, k, v, seed, rel_h, rel_w, out, lse),
          LocalArgs((period, before, after, sink), scale, dropout_p, key_w))


def _save(ctx, saved: LocalSaved, args: LocalArgs) -> None:
    ctx.mark_non_differentiable(saved.lse)
    # no gradient of lse is taken: not materialized, so autograd launches no fill of zeros
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved)
    ctx.args = args


def _operator_backward(ctx, grad_out, _grad_lse):
    saved = LocalSaved(*ctx.saved_tensors)  # unpacked once (checkpointing unpacks each read anew)
    flat = (grad_out, saved.q, saved.k, saved.v, saved.out, saved.lse, *ctx.args.pattern, ctx.args.scale,
            ctx.args.dropout_p, saved.seed, saved.rel_h, saved.rel_w, ctx.args.key_w)
    dq, dk, dv, d_rel_h, d_rel_w = call_operator(local_attention_bwd, *flat)
    biased = saved.rel_h is not None
    # the gradients of the operator's thirteen inputs
    return (dq, dk, dv) + (None,) * 7 + ((d_rel_h, d_rel_w) if biased else (None, None)) + (None,)


register_autograd(local_attention_fwd, _operator_backward, _setup_context)


class EagerLocalAttention(torch.autograd.Function):
    """The operator's forward and backward launched without the operator dispatch (eager
    mode on plain tensors, ``dispatch.dispatch_free``); on CUDA, from a signature's second
    call, replayed as a host program (``host_program``), which makes the same launches.
    ``apply(q, k, v, rel_h, rel_w, seed, args)``: the tensors autograd tracks apart."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, seed, args: LocalArgs):
        inputs = LocalInputs(q, k, v, seed, rel_h, rel_w)
        with direct_launches():
            out, lse = forward(inputs, args)
        _save(ctx, LocalSaved(*inputs, out, lse), args)
        host_program.note_forward(ctx, ctx.to_save, (), out)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        unpacked = ctx.saved_tensors
        saved = LocalSaved(*unpacked)
        with direct_launches(), host_program.backward_recording(ctx, (*unpacked, grad_out)) as recorded:
            grads = backward(saved, ctx.args, grad_out)
            if recorded is not None:  # one per host-program input (``host_inputs``' order)
                recorded(host_gradients(saved, grads))
        return grads.dq, grads.dk, grads.dv, grads.d_rel_h, grads.d_rel_w, None, None


def host_inputs(inputs: LocalInputs) -> list:
    """A host program's inputs for a call: q, k, v, then the seed and the bias's tensors
    where the call has them."""
    return [t for t in inputs if t is not None]


def host_gradients(saved: LocalSaved, grads: LocalGrads) -> tuple:
    """The gradients of ``host_inputs``, in its order (the seed takes none)."""
    pairs = ((saved.q, grads.dq), (saved.k, grads.dk), (saved.v, grads.dv), (saved.seed, None),
             (saved.rel_h, grads.d_rel_h), (saved.rel_w, grads.d_rel_w))
    return tuple(grad for tensor, grad in pairs if tensor is not None)


def forward_without_grad(inputs: LocalInputs, args: LocalArgs) -> torch.Tensor:
    """The forward where nothing takes a gradient: launched directly, no autograd node."""
    with direct_launches():
        return forward(inputs, args)[0]
