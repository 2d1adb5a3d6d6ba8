"""What ``patch_model`` did to a model, module by module: the ``PatchReport`` that
``patch_report(model)`` returns (and ``patch_timm`` keeps for every model it patched),
one ``ModuleStatus`` per window-attention module."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..ops.dispatch import ROADS


@dataclass
class ModuleStatus:
    """One window-attention module of a model."""

    name: str  # qualified name in the model, "" for the model itself
    family: str  # the adapter's: "swin", "swinv2", "swinv2_cr", "maxxvit", "tiny_vit", ...
    patched: bool
    reason: Optional[str] = None  # why not patched
    #: what the module attends where its family says ("window 14x14", "global 64x64": SAM's blocks)
    layout: Optional[str] = None


@dataclass
class PatchReport:
    """What ``patch_model`` did to a model, module by module."""

    model: str  # the model's class name
    modules: List[ModuleStatus] = field(default_factory=list)
    #: what computes the patched modules' attention where the model's parameters are now
    #: (``ops.dispatch.ROADS``: "triton", "triton-interpreter", "pytorch"); None: nothing patched
    road: Optional[str] = None

    @property
    def patched(self) -> List[ModuleStatus]:
        return [m for m in self.modules if m.patched]

    @property
    def skipped(self) -> List[ModuleStatus]:
        return [m for m in self.modules if not m.patched]

    def summary(self) -> str:
        """One line: how many modules are patched, per family, and how many kept their own (unpatched) forward."""
        families: Dict[str, int] = {}
        for m in self.patched:
            families[m.family] = families.get(m.family, 0) + 1
        by_family = ", ".join(f"{k}: {v}" for k, v in families.items()) or "none"
        text = (f"patched {len(self.patched)} of {len(self.modules)} attention modules of {self.model} "
                f"({by_family})")
        if self.skipped:
            text += f"; {len(self.skipped)} kept their own forward"
        return text

    def road_line(self) -> str:
        """'attention computed by ...' (``road``, in words), or "" where nothing is patched."""
        return f"attention computed by {ROADS[self.road]}" if self.road else ""

    def to_dict(self) -> Dict:
        """The report as plain values (JSON): model, summary, road and one dict per module."""
        return dict(model=self.model, summary=self.summary(), road=self.road, modules=[asdict(m) for m in self.modules])

    def __str__(self) -> str:
        lines = [self.summary()] + ([self.road_line()] if self.road else [])
        for m in self.modules:
            state = "patched" if m.patched else f"skipped: {m.reason}"
            layout = f" {m.layout}" if m.layout else ""
            lines.append(f"  {m.name or '<model>'} [{m.family}]{layout} {state}")
        return "\n".join(lines)


class PatchError(ValueError):
    """``patch_model(..., strict=True)`` and some modules cannot be served (``reasons`` maps
    each one's name to its reason), or the model has none to patch (``reasons`` empty)."""

    def __init__(self, model: str, reasons: Dict[str, str]):
        self.reasons = reasons
        if not reasons:
            super().__init__(f"timm_flashwin: {model} has no timm window-attention module to patch")
            return
        lines = "\n".join(f"  {name or '<model>'}: {why}" for name, why in reasons.items())
        super().__init__(f"timm_flashwin: cannot patch {len(reasons)} window-attention module(s) of {model}:\n{lines}")
