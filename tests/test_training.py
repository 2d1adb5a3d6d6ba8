"""Training features with patched models: timm's activation checkpointing, and
bit-reproducible gradients under ``torch.use_deterministic_algorithms(True)``.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter on CPU tensors (set up by conftest.py).
"""
import copy
from collections import Counter
from typing import Callable, Dict, Iterator, Tuple

import pytest
import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import KERNEL_DEVICE
from model_cases import create, images, tiny_swin
from opcases import forward_backward, make_case
from timm_flashwin import is_patched, patch_model, patch_report, window_attention
from timm_flashwin.kernels.window import config
from timm_flashwin.ops.dispatch import uses_kernels


def tiny_swinv2(**kwargs) -> nn.Module:
    """A small perturbed SwinV2 (cosine attention, cpb_mlp bias): 8x8 windows on 64x64
    images, the first stage's second block shifted (masked)."""
    args = dict(img_size=64, depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)
    args.update(kwargs)
    return create("swinv2_tiny_window8_256", **args)


#: family -> (model factory, image size); drop path off so that every pass computes the same thing
MODELS: Dict[str, Tuple[Callable[..., nn.Module], Tuple[int, int]]] = {
    "swin": (tiny_swin, (56, 56)),
    "swinv2": (tiny_swinv2, (64, 64)),
}


class OpCalls(TorchDispatchMode):
    """Counts the calls of timm_flashwin's operators (forward and backward kernels) while
    active, backward passes included: proof that the kernels, not timm's math, ran."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.matmuls = 0  # aten matrix products, any module's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "timm_flashwin":
            self.calls[func.overloadpacket.__name__] += 1
        elif func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))

    @property
    def attention(self) -> Dict[str, int]:
        """The attention operators' calls."""
        return {name: n for name, n in self.calls.items() if name.startswith("window_attention")}


def forward_backward_model(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """One training-mode forward and backward of a fixed random projection of the output,
    from zeroed gradients: (output, {parameter name: gradient})."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    (out * weight).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters())), "some parameters got no gradient"
    return out.detach(), grads


def assert_all_close(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}", **tolerance)


def assert_as_accurate_as_timm(actual: Dict[str, torch.Tensor], timm_float32: Dict[str, torch.Tensor],
                               timm_float64: Dict[str, torch.Tensor]) -> None:
    """Each of ``actual`` no further from timm's float64 result than 4 times timm's own
    float32 result is (largest absolute error, per tensor), plus 1e-6 of the float64
    result's largest magnitude (8 float32 ulps): float32 sums in another order alone put
    some tensors' largest error at 1.6 to 2.8 times timm's (tiny models, CPU), wrong math at
    orders of magnitude; and a tensor that is one sum of many terms can land nearer float64
    in timm's order by chance (a tiny SwinV2's logit-scale gradient on an H100: 6.6e-7 off,
    8e-6 of its magnitude, against timm's 1.6e-7).
    Not a fixed tolerance against timm's float32 result: the two float32 results differ by
    both their errors, and one that is more accurate than timm's may still fall outside it
    (tiny SwinV2: the gradients' largest error, relative to each tensor's largest value,
    7.0e-6 against timm's 7.7e-6, and one element of a qkv weight gradient 1.06e-5 off
    timm's, where 1e-5 was allowed)."""
    assert actual.keys() == timm_float32.keys() == timm_float64.keys()
    for name, reference in timm_float64.items():
        error = (actual[name].double() - reference).abs().max().item()
        timm_error = (timm_float32[name].double() - reference).abs().max().item()
        bound = 4 * timm_error + 1e-6 * reference.abs().max().item()
        assert error <= bound, f"{name}: {error:.3e} off float64, timm's float32 {timm_error:.3e}"


# ------------------------------------------------------------------ activation checkpointing
@pytest.fixture(params=[False, True], ids=["non-reentrant", "reentrant"])
def reentrant_checkpoints(request) -> Iterator[bool]:
    """timm's checkpoint flavour (non-reentrant is timm's default), restored afterwards."""
    if not hasattr(timm.layers, "set_reentrant_ckpt"):
        pytest.skip("this timm has no set_reentrant_ckpt")
    previous = timm.layers.use_reentrant_ckpt()
    timm.layers.set_reentrant_ckpt(request.param)
    try:
        yield request.param
    finally:
        timm.layers.set_reentrant_ckpt(previous)


@pytest.mark.parametrize("family", MODELS)
def test_grad_checkpointing(family, reentrant_checkpoints):
    """``model.set_grad_checkpointing()`` on a patched model: every block's forward is
    recomputed in the backward, through the kernels again, and the output and every
    parameter gradient equal those of the same patched model without checkpointing (the
    recomputation is exact), and are as accurate as timm's unpatched float32 ones against
    timm's float64 ones (``assert_as_accurate_as_timm``)."""
    factory, size = MODELS[family]
    timm_model = factory(drop_path_rate=0.0).to(KERNEL_DEVICE)
    model = patch_model(copy.deepcopy(timm_model))
    attention_modules = len(patch_report(model).patched)
    assert attention_modules == 4 and is_patched(model)
    x = images(2, size, device=KERNEL_DEVICE)

    timm_out, timm_grads = forward_backward_model(timm_model, x)
    with OpCalls() as plain_calls:
        plain_out, plain_grads = forward_backward_model(model, x)
    model.set_grad_checkpointing(True)
    with OpCalls() as checkpointed_calls:
        out, grads = forward_backward_model(model, x)

    assert plain_calls.attention == {"window_attention_fwd": attention_modules,
                                     "window_attention_bwd": attention_modules}
    # checkpointing runs each attention's forward a second time, in the backward
    assert checkpointed_calls.attention == {"window_attention_fwd": 2 * attention_modules,
                                            "window_attention_bwd": attention_modules}
    # the attention operators read the position-bias table and sum its gradient (in the
    # backward operator: once per module either way); no gather of its own
    for calls in (plain_calls, checkpointed_calls):
        assert not calls.calls.keys() & {"gather_position_bias", "position_bias_table_grad"}, calls.calls
    torch.testing.assert_close(out, plain_out, rtol=1e-6, atol=1e-7)
    assert_all_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    timm64_out, timm64_grads = forward_backward_model(copy.deepcopy(timm_model).double(), x.double())
    assert_as_accurate_as_timm({"out": out, **grads}, {"out": timm_out, **timm_grads},
                               {"out": timm64_out, **timm64_grads})


# ------------------------------------------------------------------ deterministic gradients
@pytest.mark.parametrize("family", MODELS)
def test_model_gradients_are_bit_reproducible(family, deterministic_algorithms, monkeypatch):
    """Two identical forward and backward passes of a patched model give bit-identical
    gradients: the backward kernels sum the bias gradient (and the position-bias table's)
    without atomics. (Under the interpreter the programs run one after another, so on CPU
    this mostly checks that the deterministic mode accepts every op of a patched model; on
    a GPU it checks the order of the reductions.) Both passes run as eager training does,
    with no dispatch mode (under one, the op and the bias gather take their dispatched
    paths); the backward launches are counted instead."""
    import timm_flashwin.ops.window as op_module
    from timm_flashwin.ops import host_program
    # the Python road, whose launches are counted (tests/test_host_program_replay.py: replays give its bits)
    monkeypatch.setattr(host_program, "ENABLED", False)
    backward_calls = []
    backward = op_module.attention_backward
    monkeypatch.setattr(op_module, "attention_backward",
                        lambda *args, **kwargs: (backward_calls.append(1), backward(*args, **kwargs))[1])
    factory, size = MODELS[family]
    model = patch_model(factory(drop_path_rate=0.0)).to(KERNEL_DEVICE)
    x = images(2, size, device=KERNEL_DEVICE)
    first_out, first = forward_backward_model(model, x)
    second_out, second = forward_backward_model(model, x)
    assert len(backward_calls) == 2 * len(patch_report(model).patched) == 8
    assert torch.equal(first_out, second_out)
    assert first.keys() == second.keys()
    differing = [name for name in first if not torch.equal(first[name], second[name])]
    assert not differing, f"gradients differ between identical passes: {differing}"


@pytest.mark.parametrize("n,single_tile", [(49, True), (144, False)], ids=["one-tile", "multi-block"])
def test_op_gradients_are_bit_reproducible(n, single_tile, deterministic_algorithms):
    """The op alone, cosine attention with bias, mask and logit scale, in both backward
    paths (the fused one-tile kernel, and the multi-block kernels with their partial
    bias-gradient sums): two identical calls, bit-identical output and gradients."""
    head_dim = 16
    assert config.backward_config(n, head_dim, torch.float32, True).single_tile(n) == single_tile
    # 2 windows sharing one mask window, whose bias gradients are summed (the one-tile
    # kernel writes one partial per window here); 2 heads, logit scales below and above the clamp
    case = make_case(2, 1, 2, n, head_dim, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE,
                     seed=n)
    assert uses_kernels(case.qkv)
    first = forward_backward(window_attention, case)
    second = forward_backward(window_attention, case)
    names = ("out", "d_qkv", "d_bias", "d_logit_scale")
    assert len(first) == len(second) == len(names)
    for name, a, b in zip(names, first, second):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, f"{name}: not a usable value"
        assert torch.equal(a, b), f"{name} differs between identical calls"


def test_grad_checkpointing_regenerates_the_attention_dropout():
    """With attention dropout, the recomputed forward draws the same seed (checkpointing
    restores the RNG state), so the gradients equal those without checkpointing."""
    model = patch_model(tiny_swin(drop_path_rate=0.0, attn_drop_rate=0.3)).to(KERNEL_DEVICE)
    x = images(2, (56, 56), device=KERNEL_DEVICE)
    runs = []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        torch.manual_seed(11)
        runs.append(forward_backward_model(model, x))
    (plain_out, plain_grads), (out, grads) = runs
    torch.testing.assert_close(out, plain_out, rtol=1e-6, atol=1e-7)
    assert_all_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    model.set_grad_checkpointing(False)
    with torch.no_grad():
        assert not torch.allclose(plain_out, model.eval()(x), rtol=1e-3, atol=1e-3)  # dropout was active


# ------------------------------------------------------------------ recomputed qkv projection
@pytest.mark.parametrize("family", MODELS)
def test_recompute_qkv(family):
    """patch_model(recompute_qkv=True): the backward computes each module's qkv projection
    again (one matrix product more per module: its output is not kept) and keeps the op's
    outputs (the forward kernel runs once); the output and every gradient equal the plain
    patched model's, with timm's block checkpointing on top too. patched() restores the
    setting, unpatching drops it."""
    from timm_flashwin import patched, unpatch_model
    from timm_flashwin.patching.adapters.base import RECOMPUTE_QKV_ATTR
    from timm_flashwin.patching.model import PATCHED_CLASSES
    factory, size = MODELS[family]
    model = patch_model(factory(drop_path_rate=0.0).to(KERNEL_DEVICE))
    x = images(2, size, device=KERNEL_DEVICE)
    with OpCalls() as plain_calls:
        plain_out, plain_grads = forward_backward_model(model, x)

    with patched(model, recompute_qkv=True):
        flags = [getattr(m, RECOMPUTE_QKV_ATTR, None) for m in model.modules() if type(m) in PATCHED_CLASSES.values()]
        assert flags == [True] * 4
        with OpCalls() as calls:
            out, grads = forward_backward_model(model, x)
        model.set_grad_checkpointing(True)
        checkpointed_out, checkpointed_grads = forward_backward_model(model, x)
        model.set_grad_checkpointing(False)
    assert not any(RECOMPUTE_QKV_ATTR in m.__dict__ for m in model.modules())

    assert calls.attention == plain_calls.attention  # the op's outputs are kept, not recomputed
    assert calls.matmuls == plain_calls.matmuls + 4  # each qkv projection once more, in the backward
    for o, g in ((out, grads), (checkpointed_out, checkpointed_grads)):
        torch.testing.assert_close(o, plain_out, rtol=1e-6, atol=1e-7)
        assert_all_close(g, plain_grads, rtol=1e-6, atol=1e-7)
    patch_model(model, recompute_qkv=True)
    unpatch_model(model)
    assert not any(RECOMPUTE_QKV_ATTR in m.__dict__ for m in model.modules())


def test_recompute_qkv_for_some_modules():
    """recompute_qkv as a predicate (module, qualified name) -> bool: only the modules it
    picks recompute their projection (one matrix product more each); gradients unchanged.
    Anything but a bool or a callable is refused, naming the argument."""
    from timm_flashwin.patching.adapters.base import RECOMPUTE_QKV_ATTR
    from timm_flashwin.patching.model import PATCHED_CLASSES
    model = patch_model(tiny_swin(drop_path_rate=0.0).to(KERNEL_DEVICE))
    x = images(2, (56, 56), device=KERNEL_DEVICE)
    with OpCalls() as plain_calls:
        plain_out, plain_grads = forward_backward_model(model, x)
    asked = []

    def first_stage(module: nn.Module, name: str) -> bool:
        asked.append((type(module), name))
        return name.startswith("layers.0.")

    patch_model(model, recompute_qkv=first_stage)
    attention = {name: type(m) for name, m in model.named_modules() if type(m) in PATCHED_CLASSES.values()}
    assert sorted(asked, key=str) == sorted(((cls, name) for name, cls in attention.items()), key=str)
    recomputing = [name for name, m in model.named_modules() if getattr(m, RECOMPUTE_QKV_ATTR, False)]
    assert recomputing == ["layers.0.blocks.0.attn", "layers.0.blocks.1.attn"]
    with OpCalls() as calls:
        out, grads = forward_backward_model(model, x)
    assert calls.attention == plain_calls.attention
    assert calls.matmuls == plain_calls.matmuls + 2
    torch.testing.assert_close(out, plain_out, rtol=1e-6, atol=1e-7)
    assert_all_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="recompute_qkv must be a bool or a callable"):
        patch_model(model, recompute_qkv="layers.0.")
    assert recomputing == [name for name, m in model.named_modules() if getattr(m, RECOMPUTE_QKV_ATTR, False)]


def test_recompute_qkv_regenerates_the_attention_dropout():
    """With attention dropout and recompute_qkv, the backward's recomputation draws the
    same seed (checkpointing restores the RNG state) and keeps the op's outputs: the
    gradients equal those without recomputation."""
    model = patch_model(tiny_swin(drop_path_rate=0.0, attn_drop_rate=0.3)).to(KERNEL_DEVICE)
    x = images(2, (56, 56), device=KERNEL_DEVICE)
    runs = []
    for recompute in (False, True):
        patch_model(model, recompute_qkv=recompute)
        torch.manual_seed(11)
        runs.append(forward_backward_model(model, x))
    (plain_out, plain_grads), (out, grads) = runs
    torch.testing.assert_close(out, plain_out, rtol=1e-6, atol=1e-7)
    assert_all_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        assert not torch.allclose(plain_out, model.eval()(x), rtol=1e-3, atol=1e-3)  # dropout was active
