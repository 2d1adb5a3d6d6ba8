"""Proof that patching changes nothing but speed: a patched copy of a timm model against
the unpatched model, layer by layer, with a float64 copy of the unpatched model as the
referee.

Every window-attention layer's output (the output of the timm block holding the module,
or of the module where no timm block holds it; captured with forward hooks on the blocks,
whose patched method then reads its windows from the feature map as it does unhooked; the
same images through all three models), the final output (and top-1 agreement) and, with
``train=True``, every parameter's gradient are compared. For each quantity:

    err_timm  = ||timm - float64|| / ||float64||       (unpatched, requested dtype;
                the larger of two runs, see below)
    err_ours  = ||patched - float64|| / ||float64||
    diff      = ||patched - timm|| / ||timm||

A forward tensor passes when err_ours <= max(rtol, 2 * err_timm) + atol / rms(float64):
patching may not make the model more than twice as wrong as timm's own arithmetic is,
nor worse than rtol. A gradient passes when err_ours <= max(rtol, 4 * err_timm,
2 * err_timm_all) + atol / rms, err_timm_all being timm's error over all gradients
together: with logit scales near the clamp a SwinV2 is chaotic enough that timm's own
float32 gradients are 0.5-2 % off float64, and its error on one tensor is a noisy sample
of that level (measured: 2.6e-4 on a tensor where the overall level was 7e-3; the
patched/timm ratio on single logit-scale gradients reached 2.5). A tensor whose own
timm error is 100 % or more (a true value of ~0, such as the gradient of SwinV2-CR's
meta_mlp output bias, which softmax's shift invariance makes exactly 0) cannot be judged
at that precision: it is reported as ill-conditioned, not counted.

timm's error on one tensor is one draw of its rounding noise, and the patched model's is
another: over 12 seeds of the verify test (SwinV2-tiny, float32, 2652 gradients) their
ratio had a median of 0.95, yet reached 5.3 on single logit-scale gradients, and a CI
machine whose CPU rounds differently failed one at 5.7x. So timm runs twice, the second
time on the images moved by one float32 ulp each (``jitter_images``), and err_timm is the
larger of its two errors: a second draw of the same noise, not a looser factor.

float16 and bfloat16 run under autocast (float32 weights), as in AMP; float16 training
scales the loss as a GradScaler would (down by 2^8 until timm's own gradients are
finite) and unscales the gradients before comparing.
"""
from __future__ import annotations

import copy
import difflib
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .comparison import Comparison, compare, group_error, jitter_images, larger_error
from ..ops.dispatch import road
from ..patching.factory import timm_create_model
from .hf_models import HF_PREFIX, build_hf_model
from .tv_models import TV_PREFIX, build_tv_model
from ..patching.model import _attention_modules, patch_model, patch_report
from .tolerances import ATOL, GRADIENT_FACTOR, RTOL, possessive  # the rule (the module docstring says why)
from .usage import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- perturb
@torch.no_grad()
def perturb_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Make attention matter in a randomly initialized model, in place.

    SwinV2 zero-inits its res-post-norm weights (norm1/norm2), so a fresh SwinV2 ignores
    its attention and any kernel "matches"; its logit scales all start at ln 10 and its
    bias tables near 0. This sets LayerNorm weights to 1 + 0.1 N(0,1) (biases
    0.05 N(0,1)), logit scales log-uniform in [ln 2, ln 120] (about 1 head in 20 above
    the clamp at ln 100), V1 bias tables (and TinyViT's, zeros) to N(0,1), SAM's decomposed
    tables (zeros) to N(0, 1 / head_dim), and adds 0.02 N(0,1) to every other floating
    parameter. (Uniform scales up to 150 made
    SwinV2-CR so chaotic that timm's own bfloat16 output was 20 % off float64 on CPU;
    this gives 9 %, SwinV2 2 %.)
    """
    g = torch.Generator().manual_seed(seed)
    noise = lambda p: torch.randn(p.shape, generator=g).to(p.device, p.dtype)  # noqa: E731
    handled = set()
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and module.weight is not None:
            module.weight.copy_(1 + 0.1 * noise(module.weight))
            module.bias.copy_(0.05 * noise(module.bias))
            handled.update({id(module.weight), id(module.bias)})
    for name, p in model.named_parameters():
        if id(p) in handled or not p.is_floating_point():
            continue
        if name.endswith("logit_scale"):
            u = torch.rand(p.shape, generator=g) * (math.log(120.0) - math.log(2.0)) + math.log(2.0)
            p.copy_(u.to(p.device, p.dtype))
        elif name.endswith(("relative_position_bias_table", "attention_biases")):
            p.copy_(noise(p))
        elif name.endswith(("rel_pos_h", "rel_pos_w")):  # SAM's / ViTDet's (zeros): q . R of about 1
            p.copy_(noise(p) * p.shape[-1] ** -0.5)
        else:
            p.add_(0.02 * noise(p))
    return model


def attention_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of what verify compares per window-attention layer: the timm block
    holding a served module as ``.attn`` (a hook on the module itself would make the
    patched block call it, timm's way, rather than read its windows from the map:
    ``patching._feature_map_grid``), or the module where no timm block holds it."""
    modules = dict(model.named_modules())
    layers = []
    for name, module, adapter, family in _attention_modules(model):
        if adapter is None:
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules.get(parent_name) if name else None
        block_type = adapter.block_type()
        if block_type is not None and isinstance(parent, block_type) and getattr(parent, "attn", None) is module:
            layers.append((parent_name, parent))
        else:
            layers.append((name, module))
    return layers


# --------------------------------------------------------------------------- results
@dataclass
class VerifyResult:
    """What ``verify_model`` found: a ``Comparison`` per attention layer, of the output and,
    with ``train``, of every parameter's gradient; ``passed`` when all of them pass."""

    model: str
    settings: Dict
    backend: str  # what ran the patched attention: "triton", "triton-interpreter", "pytorch"
    perturbed: bool
    patched_modules: int
    layers: List[Comparison] = field(default_factory=list)
    output: Optional[Comparison] = None
    top1_agreement: float = float("nan")  # patched vs timm
    top1_timm_vs_float64: float = float("nan")
    top1_ours_vs_float64: float = float("nan")
    loss_scale: float = 1.0  # float16 training (see the module docstring)
    grads: List[Comparison] = field(default_factory=list)
    gradient_floor: float = float("nan")  # the unpatched model's error over all gradients together

    @property
    def passed(self) -> bool:
        parts = self.layers + self.grads + ([self.output] if self.output else [])
        return bool(parts) and all(c.passed for c in parts)

    def failures(self) -> List[Comparison]:
        return [c for c in self.layers + ([self.output] if self.output else []) + self.grads if not c.passed]

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def verdict(self) -> str:
        what = "forward" + (" and gradients" if self.settings.get("train") else "")
        if self.passed:
            library = self.settings.get("library", "timm")
            return (f"PASS {self.model}: {what} of the patched model match the unpatched {library} model "
                    f"({self.patched_modules} attention modules patched, {self.settings['dtype']}, {self.backend})")
        return (f"FAIL {self.model}: {len(self.failures())} of {len(self.layers) + len(self.grads) + 1} compared "
                f"tensors beyond tolerance ({self.settings['dtype']}, {self.backend})")


# --------------------------------------------------------------------------- building
def _first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, for a one-line usage error."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def resolve_device(device: Optional[str]) -> torch.device:
    """The device verify runs on (None: cuda when available, else cpu); UsageError for one
    this machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA was asked for but no CUDA device is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev


def build_model(name: str, *, img_size=None, pretrained: bool = False, checkpoint: Optional[str] = None,
                train: bool = False, seed: int = 0, model_kwargs: Optional[Dict] = None) -> nn.Module:
    """timm.create_model(name, **model_kwargs), its random init drawn from ``seed`` (the same
    seed, the same model: a failure can be rerun) without touching the caller's RNG state.
    A name starting with "hf:" is a transformers CONFIG (``hf_models``; ``model_kwargs``
    then set config attributes), one starting with "tv:" a torchvision model (``tv_models``;
    ``model_kwargs`` go to its builder)."""
    if name.startswith(TV_PREFIX):
        model = build_tv_model(name[len(TV_PREFIX):], img_size=img_size, pretrained=pretrained, train=train,
                               seed=seed, overrides=model_kwargs)
        if checkpoint is not None:
            load_checkpoint(model.model, checkpoint)
        return model
    if name.startswith(HF_PREFIX):
        model = build_hf_model(name[len(HF_PREFIX):], img_size=img_size, pretrained=pretrained, train=train,
                               seed=seed, overrides=model_kwargs)
        if checkpoint is not None:
            load_checkpoint(model.model, checkpoint)
        return model
    import timm
    if name not in timm.list_models(pretrained=False):
        close = difflib.get_close_matches(name, timm.list_models("swin*"), n=4, cutoff=0.5) or \
            difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"unknown timm model '{name}'{hint}")
    kwargs = dict(model_kwargs or {})
    if img_size is not None:
        kwargs["img_size"] = img_size
    if train:
        kwargs["drop_path_rate"] = 0.0  # stochastic depth would make the two runs differ
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = timm_create_model()(name, pretrained=pretrained, **kwargs)
            except TypeError as exc:
                if "img_size" not in kwargs or "img_size" not in str(exc):
                    raise
                # a model of any input size (TinyViT, DaViT) takes none: the images set it
                kwargs.pop("img_size")
                torch.manual_seed(seed)
                model = timm_create_model()(name, pretrained=pretrained, **kwargs)
    except TypeError as exc:
        raise UsageError(f"{name}: cannot build with {kwargs}: {exc}") from None
    except (OSError, RuntimeError, ValueError) as exc:
        if pretrained:
            raise UsageError(f"{name}: the pretrained weights could not be fetched (offline?): "
                             f"{_first_line(exc)}") from None
        raise
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model


def load_checkpoint(model: nn.Module, path: str) -> None:
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint {path}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # not a checkpoint at all (torch.load reads /etc/passwd as "list index out of range")
        raise UsageError(f"--checkpoint {path}: not a checkpoint torch.load (weights only) or safetensors can read "
                         f"({type(exc).__name__}: {_first_line(exc)})") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise UsageError(f"--checkpoint {path}: holds a {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:
        # load_state_dict lists every problem on its own line after a header: name the first
        details = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()] or [str(exc)]
        more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
        raise UsageError(f"--checkpoint {path} does not fit {type(model).__name__}: {details[0][:300]}{more}") from None


def backend_name(device: torch.device, dtype: torch.dtype) -> str:
    """What computes the patched attention: "triton", "triton-interpreter" or "pytorch"."""
    return road(device, dtype)


# --------------------------------------------------------------------------- verify
def verify_model(
    name: str,
    *,
    img_size=None,
    batch: int = 2,
    dtype: str = "float32",
    device: Optional[str] = None,
    train: bool = False,
    checkpoint: Optional[str] = None,
    pretrained: bool = False,
    seed: int = 0,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    model_kwargs: Optional[Dict] = None,
) -> VerifyResult:
    """Build ``name`` (``model_kwargs``: more arguments of timm.create_model, such as a
    smaller configuration), patch a copy, and compare both against a float64 copy.

    Raises UsageError for problems with the request itself.
    """
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if batch < 1:
        raise UsageError(f"--batch {batch}: expected an integer >= 1")
    dev = resolve_device(device)
    rtol = RTOL[dtype] if rtol is None else rtol
    atol = ATOL[dtype] if atol is None else atol
    model = build_model(name, img_size=img_size, pretrained=pretrained, checkpoint=checkpoint, train=train, seed=seed,
                        model_kwargs=model_kwargs)
    if not any(adapter is not None for _, _, adapter, _ in _attention_modules(model)):
        raise UsageError(f"{name} ({type(model).__name__}) has no timm window attention to patch")
    library = "transformers" if name.startswith(HF_PREFIX) else "timm"  # what the unpatched model is
    perturbed = not (pretrained or checkpoint)
    if perturbed:
        perturb_(model, seed)
    model.train(train)

    reference = copy.deepcopy(model).to(dev, torch.float64)
    timm_model = model.to(dev)
    ours = patch_model(copy.deepcopy(timm_model))
    report = patch_report(ours)

    cfg = timm_model.pretrained_cfg if hasattr(timm_model, "pretrained_cfg") else {}
    # a torchvision model's input size is its own (its img_size applied: a video model's frames too)
    size = cfg["input_size"][1:] if name.startswith(TV_PREFIX) else img_size or cfg.get("input_size", (3, 224, 224))[1:]
    size = (size, size) if isinstance(size, int) else tuple(size)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, *size, generator=gen).to(dev)

    def run(net: nn.Module, float64: bool, loss_scale: float = 1.0, x: torch.Tensor = images
            ) -> Dict[str, torch.Tensor]:
        captured: Dict[str, torch.Tensor] = {}
        # transformers' attention modules return tuples: (output, ...)
        hooks = [module.register_forward_hook(lambda mod, args, out, key=mod_name: captured.__setitem__(
                     key, out[0] if isinstance(out, tuple) else out))
                 for mod_name, module in attention_layers(net)]
        try:
            torch.manual_seed(seed)  # same dropout draws in every run (SwinV2-CR's meta_mlp)
            x = x.double() if float64 else x
            with torch.autocast(dev.type, dtype=DTYPES[dtype], enabled=dtype != "float32" and not float64):
                out = net(x)
            if train:
                g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dev, out.dtype)
                (out * g).sum().mul(loss_scale).backward()
                if loss_scale != 1.0:
                    for p in net.parameters():
                        if p.grad is not None:
                            p.grad.div_(loss_scale)
        finally:
            for h in hooks:
                h.remove()
        captured["<output>"] = out
        return captured

    loss_scale = 1.0
    with torch.set_grad_enabled(train):
        try:
            ref_out = run(reference, True)
        except (RuntimeError, AssertionError, ValueError) as exc:  # timm's own model, before any patched call
            raise UsageError(f"{name} ({possessive(library)} own model, unpatched) cannot run images of "
                             f"{size[0]}x{size[1]}: {_first_line(exc)}") from None
        timm_out = run(timm_model, False)
        while train and dtype == "float16" and loss_scale > 2.0 ** -32 and not all(
                torch.isfinite(p.grad).all() for p in timm_model.parameters() if p.grad is not None):
            loss_scale /= 2 ** 8  # as a GradScaler backs off after an overflow
            timm_model.zero_grad(set_to_none=True)
            timm_out = run(timm_model, False, loss_scale)
        timm_grads = {n: p.grad.detach().clone() for n, p in timm_model.named_parameters() if p.grad is not None}
        timm_model.zero_grad(set_to_none=True)
        timm_again = run(timm_model, False, loss_scale, jitter_images(images, seed))  # module docstring
        our_out = run(ours, False, loss_scale)

    settings = dict(img_size=list(size), batch=batch, dtype=dtype, device=str(dev), train=train, seed=seed,
                    rtol=rtol, atol=atol, checkpoint=checkpoint, pretrained=pretrained, model_kwargs=model_kwargs or {},
                    library=library)
    result = VerifyResult(name, settings, backend_name(dev, DTYPES[dtype]), perturbed, len(report.patched),
                          loss_scale=loss_scale)
    for key in ref_out:
        if key == "<output>":
            continue
        result.layers.append(compare(key, our_out[key], timm_out[key], ref_out[key], rtol, atol,
                                     timm_again=timm_again[key]))
    result.output = compare("<output>", our_out["<output>"], timm_out["<output>"], ref_out["<output>"], rtol, atol,
                            timm_again=timm_again["<output>"])
    top1 = {k: v["<output>"].argmax(-1) for k, v in (("ours", our_out), ("timm", timm_out), ("ref", ref_out))}
    result.top1_agreement = (top1["ours"] == top1["timm"]).float().mean().item()
    result.top1_timm_vs_float64 = (top1["timm"] == top1["ref"]).float().mean().item()
    result.top1_ours_vs_float64 = (top1["ours"] == top1["ref"]).float().mean().item()
    if train:
        our_grads, timm_again_grads, ref_grads = ({n: p.grad for n, p in net.named_parameters() if p.grad is not None}
                                                  for net in (ours, timm_model, reference))
        grads = [our_grads, timm_grads, ref_grads]
        if not (our_grads.keys() == timm_grads.keys() == ref_grads.keys()):
            for pname in set().union(*grads) - set.intersection(*(set(g) for g in grads)):
                result.grads.append(Comparison(pname, math.nan, math.nan, math.nan, math.nan, False))
        shared = [n for n in ref_grads if n in our_grads and n in timm_grads and n in timm_again_grads]
        floor = result.gradient_floor = larger_error(*(group_error({n: g[n] for n in shared},
                                                                   {n: ref_grads[n] for n in shared})
                                                       for g in (timm_grads, timm_again_grads)))
        for pname in shared:
            result.grads.append(compare(pname, our_grads[pname], timm_grads[pname], ref_grads[pname], rtol, atol,
                                        floor, GRADIENT_FACTOR, timm_again_grads[pname]))
    return result


__all__ = ["ATOL", "Comparison", "GRADIENT_FACTOR", "RTOL", "UsageError", "VerifyResult", "attention_layers",
           "build_model", "perturb_", "verify_model"]
