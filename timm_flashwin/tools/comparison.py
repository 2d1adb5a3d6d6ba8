"""The arithmetic of ``verify``'s comparisons: relative errors against a float64 referee,
the bound a tensor passes within, and the images of timm's second run. verify.py's
docstring says why the bounds are what they are; the tests that compare a patched model
with timm use the same functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass
class Comparison:
    """One compared tensor: an attention layer's output, the model output, a gradient."""

    name: str
    err_timm: float
    err_ours: float
    diff: float
    max_abs: float  # max |patched - timm|
    passed: bool
    ill_conditioned: bool = False  # timm's own error >= 100 %: reported, not judged


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (any shapes that broadcast; b's norm at least 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def jitter_images(images: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``images`` with every element moved one ulp up or down at random (its own dtype):
    the input of timm's second run, whose error is a second draw of timm's rounding noise."""
    up = torch.rand(images.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    towards = torch.where(up, math.inf, -math.inf).to(images.device, images.dtype)
    return torch.nextafter(images, towards)


def larger_error(first: float, second: Optional[float]) -> float:
    """The larger of timm's errors in its two runs; a non-finite second run is not counted."""
    return second if second is not None and math.isfinite(second) and second > first else first


def compare(name: str, ours: torch.Tensor, timm_out: torch.Tensor, ref: torch.Tensor, rtol: float,
            atol: float, err_floor: float = 0.0, factor: float = 2.0,
            timm_again: Optional[torch.Tensor] = None) -> Comparison:
    """Whether ``ours`` (the patched model's tensor, any shape) passes against ``ref`` (the
    float64 referee's, the same shape), timm's ``timm_out`` its yardstick:
    err_ours <= max(rtol, factor * err_timm, 2 * err_floor) + atol / rms(ref);
    ``err_floor``: timm's error on a whole group the tensor belongs to (all gradients);
    ``timm_again``: timm's output from its second run (jittered images), if any; err_timm
    is then the larger of the two runs' errors."""
    again = None if timm_again is None else relative_error(timm_again, ref)
    err_timm = larger_error(relative_error(timm_out, ref), again)
    err_ours = relative_error(ours, ref)
    rms = ref.detach().double().pow(2).mean().sqrt().clamp_min(1e-30).item()
    bound = max(rtol, factor * err_timm, 2 * err_floor) + atol / rms
    ill = bool(err_timm >= 1.0)
    return Comparison(name, err_timm, err_ours, relative_error(ours, timm_out),
                      (ours.detach().double() - timm_out.detach().double()).abs().max().item(),
                      bool(ill and math.isfinite(err_ours)) or bool(err_ours <= bound), ill)  # NaN fails


def group_error(tensors: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """Relative error of a group of tensors taken together (all gradients of a model)."""
    names = sorted(reference)
    return relative_error(torch.cat([tensors[n].detach().double().flatten() for n in names]),
                          torch.cat([reference[n].detach().double().flatten() for n in names]))
