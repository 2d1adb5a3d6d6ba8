"""verify's rule: the tolerances and the factors a tensor passes within (verify.py's docstring
says why), and the rule in words, as ``timm-flashwin verify`` prints it and its ``--help``
states it. Plain values, no torch: the command line's help reads them."""
from __future__ import annotations

from typing import Tuple

#: Default relative tolerances per dtype (the README states them), and absolute floors.
RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
ATOL = {"float32": 1e-6, "bfloat16": 1e-4, "float16": 1e-5}
#: A forward tensor may be this many times as far from float64 as the unpatched model's own
#: tensor; a gradient GRADIENT_FACTOR times, or twice the unpatched model's error over all
#: gradients together, whichever is larger.
FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 4.0


def possessive(name: str) -> str:
    """"timm's", "transformers'"."""
    return name + ("'" if name.endswith("s") else "'s")


def rule_lines(rtol: str = "rtol", atol: str = "atol", library: str = "the unpatched model") -> Tuple[str, str]:
    """The rule in words, forward tensors and gradients: what ``comparison.compare`` checks,
    with ``rtol`` and ``atol`` given as numbers or names."""
    own = possessive(library)
    return (f"a tensor passes when its error vs float64 <= max({rtol}, {FORWARD_FACTOR:g} x {own} own error) "
            f"+ {atol} / rms(float64)",
            f"a gradient passes when its error <= max({rtol}, {GRADIENT_FACTOR:g} x {own} own error, 2 x {own} "
            f"error over all gradients) + {atol} / rms")


def rule(rtol: str = "rtol", atol: str = "atol", library: str = "the unpatched model") -> str:
    """``rule_lines`` in one sentence."""
    return "; ".join(rule_lines(rtol, atol, library))


def defaults() -> str:
    """'float32 1e-04 / 1e-06, ...': each dtype's default rtol / atol."""
    return ", ".join(f"{dtype} {RTOL[dtype]:.0e} / {ATOL[dtype]:.0e}" for dtype in RTOL)
