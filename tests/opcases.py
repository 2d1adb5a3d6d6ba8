"""Inputs for the op tests and the comparison against the float64 reference."""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from timm_flashwin.kernels import fast_launch
from timm_flashwin.kernels.window.plan import call_plan
from timm_flashwin.ops import host_program
from timm_flashwin.kernels.window.tiles import CLAMP_GRADIENT_AT_BOUND_VALUE as CLAMP_GRADIENT_AT_BOUND
from timm_flashwin.kernels.window.tiles import LOGIT_SCALE_MAX_VALUE as LOGIT_SCALE_MAX
from timm_flashwin.ops.reference import window_attention_reference
from window_calls import window_call

#: Relative error bound (||x - ref|| / ||ref||) against the float64 reference, for the
#: output and every gradient. These are the numbers the README and docs/support.md state.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}

#: Logit scales below and above the clamp at ln(100), per head. Exactly float32(ln 100) is
#: left out here: torch.clamp passes the gradient there on CUDA and not on CPU, and the
#: float64 reference always clamps (test_op_edge_cases.py tests that point against torch.clamp).
LOGIT_SCALES = [math.log(5.0), math.log(200.0), math.log(30.0), math.log(90.0), 0.0, math.log(60.0)]


def shift_mask(num_windows: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """A mask like timm's shifted-window mask: 0 within a region, -100 across regions.
    Windows 1, 4, 7, ... are one region (all 0), as timm's windows away from the last row
    and column are: the kernels that stream key blocks run those without the mask."""
    regions = torch.randint(0, 3, (num_windows, n), generator=generator)
    regions[1::3] = 0
    same = regions[:, :, None] == regions[:, None, :]
    return torch.where(same, 0.0, -100.0)


@dataclass
class Case:
    qkv: torch.Tensor
    num_heads: int
    bias: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    scale: Optional[float]
    logit_scale: Optional[torch.Tensor]
    grad_out: torch.Tensor

    def kwargs(self, **override) -> Dict:
        kw = dict(bias=self.bias, mask=self.mask, scale=self.scale, logit_scale=self.logit_scale)
        kw.update(override)
        return kw

    def leaves(self) -> List[torch.Tensor]:
        return [t for t in (self.qkv, self.bias, self.logit_scale) if t is not None]


def make_case(windows: int, num_windows: int, heads: int, n: int, head_dim: int, *, cosine: bool, masked: bool,
              dtype: torch.dtype, device, param_dtype: torch.dtype = torch.float32, seed: int = 0,
              with_bias: bool = True) -> Case:
    """Random inputs in the dtypes a patched model passes: qkv (and grad) in ``dtype``,
    bias and logit scale in ``param_dtype`` (float32 under autocast)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(windows, n, 3 * heads * head_dim, generator=g).to(dtype)
    bias = (2 * torch.randn(heads, n, n, generator=g)).to(param_dtype) if with_bias else None
    mask = shift_mask(num_windows, n, g) if masked else None
    logit_scale = None
    scale = None
    if cosine:
        logit_scale = torch.tensor([LOGIT_SCALES[h % len(LOGIT_SCALES)] for h in range(heads)]).to(param_dtype)
    else:
        scale = head_dim ** -0.5
    grad_out = torch.randn(windows, n, heads * head_dim, generator=g).to(dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Case(move(qkv), heads, move(bias), move(mask), scale, move(logit_scale), move(grad_out))


def forward_backward(fn, case: Case, dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
    """[out, d qkv, d bias, d logit_scale] (those that exist), inputs cast to ``dtype``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in case.leaves()]
    it = iter(leaves)
    qkv = next(it)
    bias = next(it) if case.bias is not None else None
    logit_scale = next(it) if case.logit_scale is not None else None
    mask = case.mask.to(dtype) if (case.mask is not None and dtype is not None) else case.mask
    out = fn(qkv, case.num_heads, bias=bias, mask=mask, scale=case.scale, logit_scale=logit_scale)
    out.backward(case.grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def bias_as_read(case: Case) -> Case:
    """The case with its bias as the kernels read it: where they stream key blocks with
    16-bit inputs (``bias_mask.streamed_bias``), a float16 copy of the bias times log2(e),
    rounded as the copy kernel rounds it (float32 product, then float16), divided by log2(e)
    again in float64; else unchanged.

    Where the kernels read the mask folded into that copy (``bias_mask.folds_mask``), the
    reference keeps the mask exact: where it is 0 the copy rounds the bias alone, as here;
    where it is large (timm's -100) the copy's rounding moves logits whose probabilities
    are e^-100 of their row's largest, and other masks' rounding stays within the 16-bit
    tolerances (test_op_bias_mask.py's folded-mask test).

    The float64 reference takes this bias, so that it checks the kernels' arithmetic. The
    rounding (|error| <= |bias * log2(e)| * 2^-12) moves the output and the qkv and bias
    gradients far less than the 16-bit tolerances, but the logit-scale gradient, a sum whose
    terms cancel, by up to a few 1e-2 of its value where that value is small (H200 and CPU,
    N = 144: -1.08 against -1.04); test_op_bias_mask.py's test of the float16 bias copy bounds that
    effect against the exact bias."""
    if case.bias is None or case.qkv.dtype not in (torch.float16, torch.bfloat16):
        return case
    n, head_dim = case.qkv.shape[1], case.qkv.shape[2] // (3 * case.num_heads)
    if not call_plan(window_call(n, head_dim, case.qkv.dtype, case.logit_scale is not None)).streams:
        return case
    log2e = 1.0 / math.log(2.0)
    return replace(case, bias=(case.bias.float() * log2e).half().double() / log2e)


class Reference(list):
    """The float64 reference's [out, d qkv, d bias, d logit_scale] and, for a gradient that is
    a sum whose terms cancel, the sums of its terms' absolute values (``magnitudes``, by
    name): its condition. ``assert_matches_reference`` bounds such a gradient's error
    relative to those sums, not to its value."""

    def __init__(self, values, magnitudes: Optional[Dict[str, torch.Tensor]] = None):
        super().__init__(values)
        self.magnitudes = magnitudes or {}


def logit_scale_term_sums(qkv: torch.Tensor, num_heads: int, *, bias: Optional[torch.Tensor],
                          mask: Optional[torch.Tensor], logit_scale: torch.Tensor, grad_out: torch.Tensor,
                          dropout_factor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(H,) float64: sum over windows and token pairs of |dL/dS * dS/d(logit_scale)|, with
    S = exp(min(logit_scale, ln 100)) q^ k^^T (dS/d(logit_scale) = S where not clamped, else 0).

    The logit-scale gradient is the sum of these terms, and every row's dL/dS sums to zero
    (the softmax's Jacobian): the terms cancel, by design, to a value that can be a small
    fraction of their magnitude (1e-2 and less). Its rounding error in any arithmetic is a
    fraction of this magnitude, not of the value: float32 kernels summing the same terms
    in another order land 1e-4 of the value apart on some inputs (triton 3.8's interpreter
    against float64: 1.17e-4), which is 1e-6 of the magnitude. So the tests bound this
    gradient's error relative to these sums (``Reference``)."""
    windows, n, channels = qkv.shape
    head_dim = channels // (3 * num_heads)
    q, k, v = qkv.double().reshape(windows, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    head_scale = logit_scale.double().reshape(1, num_heads, 1, 1).clamp(max=LOGIT_SCALE_MAX).exp()
    with torch.enable_grad():
        scores = (cos * head_scale).requires_grad_()
        logits = scores if bias is None else scores + bias.double().reshape(1, num_heads, n, n)
        if mask is not None:
            periods = mask.shape[0]
            logits = (logits.view(-1, periods, num_heads, n, n) + mask.double()[None, :, None]).view(logits.shape)
        p = logits.softmax(-1)
        if dropout_factor is not None:
            p = p * dropout_factor.double()
        out = (p @ v).transpose(1, 2).reshape(windows, n, num_heads * head_dim)
        (d_scores,) = torch.autograd.grad(out, scores, grad_out.double())
    # zero where the clamp is active: the gradient is exactly 0 there, and must be
    passes = (logit_scale.double() < LOGIT_SCALE_MAX) | ((logit_scale.double() == LOGIT_SCALE_MAX)
                                                          & CLAMP_GRADIENT_AT_BOUND)
    return (d_scores * scores.detach()).abs().sum((0, 2, 3)) * passes.reshape(num_heads)


def reference_forward_backward(case: Case, dropout_factor: Optional[torch.Tensor] = None) -> Reference:
    """The float64 reference of [out, d qkv, d bias, d logit_scale], with the bias as the
    kernels read it (``bias_as_read``), and the logit-scale gradient's condition
    (``logit_scale_term_sums``); ``dropout_factor`` (B_, H, N, N): the kernels' dropout."""
    case = bias_as_read(case)
    reference = window_attention_reference
    if dropout_factor is not None:
        reference = functools.partial(window_attention_reference, dropout_factor=dropout_factor)
    return Reference(forward_backward(reference, case, torch.float64), gradient_conditions(case, dropout_factor))


def gradient_conditions(case: Case, dropout_factor: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """``Reference.magnitudes`` of a case in the partitioned layout (B_, N, 3*H*D): the
    logit-scale gradient's ``logit_scale_term_sums`` where there is a logit scale."""
    if case.logit_scale is None:
        return {}
    return {"d_logit_scale": logit_scale_term_sums(case.qkv, case.num_heads, bias=case.bias, mask=case.mask,
                                                   logit_scale=case.logit_scale, grad_out=case.grad_out,
                                                   dropout_factor=dropout_factor)}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _log_error(name: str, tol: float, err: float) -> None:
    """With FLASHWIN_ERRLOG=PATH set, append (test, tensor, bound, error) as a tab-separated
    line to PATH.<pid> (one file per pytest-xdist worker): the measured errors that
    docs/support.md's accuracy section quotes the largest of."""
    path = os.environ.get("FLASHWIN_ERRLOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(f"{path}.{os.getpid()}", "a") as log:
            log.write(f"{test}\t{name}\t{tol:g}\t{err:.3e}\n")


def assert_matches_reference(results, reference, tol: float, names=("out", "d_qkv", "d_bias", "d_logit_scale")):
    """Every result within ``tol`` relative error of the reference: relative to its value,
    or, for a gradient whose terms cancel (a ``Reference``'s ``magnitudes``), to the sums of
    its terms' absolute values. On failure the element-wise report of
    torch.testing.assert_close says where."""
    assert len(results) == len(reference)
    magnitudes = getattr(reference, "magnitudes", {})
    for name, actual, expected in zip(names, results, reference):
        assert actual is not None, f"{name}: no gradient"
        assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if name in magnitudes:
            scale = torch.maximum(magnitudes[name].to(expected.device), expected.double().abs())
            err = ((actual.double() - expected.double()).norm() / scale.norm().clamp_min(1e-30)).item()
        else:
            err = relative_error(actual, expected)
        _log_error(name, tol, err)
        if not err <= tol:  # also catches NaN
            torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=0,
                                       msg=lambda m: f"{name}: relative error {err:.2e} > {tol:.0e}\n{m}")


@contextlib.contextmanager
def kernels_launched():
    """Yields the list of the names of the kernels launched in the block, as
    ``fast_launch.RECORD`` sees every direct launch and every interpreted one; host programs
    are switched off (a replay launches from C++, and a recording takes the hook)."""
    names = []
    with host_program.switched_off():
        fast_launch.RECORD = lambda kernel, compiled, grid, args: names.append(kernel.__name__)
        try:
            yield names
        finally:
            fast_launch.RECORD = None
