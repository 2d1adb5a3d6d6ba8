"""The patcher: patched timm models against timm's own unpatched modules, and every
promised behaviour of patch_model / unpatch_model / patched / is_patched."""
import copy
import io
import logging
import math
import os
import sys

import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from opcases import relative_error
from timm_flashwin import PatchError, is_patched, patch_model, patch_report, patched, unpatch_model
from timm_flashwin.adapters import ADAPTERS, WindowAttentionAdapter
from timm_flashwin.adapters.base import BLOCK_GRID_ATTR
from timm_flashwin.patching import FlashSwinTransformerBlock
from timm_flashwin.window_grid import WindowGrid
from timm_flashwin.comparison import compare, group_error, jitter_images, larger_error
from timm_flashwin.verify import GRADIENT_FACTOR, perturb_

SWIN_V1 = timm.models.swin_transformer.WindowAttention
SWIN_V2 = timm.models.swin_transformer_v2.WindowAttention
SWIN_CR = timm.models.swin_transformer_v2_cr.WindowMultiHeadAttention


def create(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """timm.create_model with a seeded initialization, then perturbed (verify.perturb_)."""
    torch.manual_seed(seed)
    return perturb_(timm.create_model(name, **kwargs), seed)


def tiny_swin(**kwargs) -> nn.Module:
    """A small Swin V1 with shifted windows (two blocks per stage), for quick tests."""
    args = dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)
    args.update(kwargs)
    return create("swin_tiny_patch4_window7_224", **args)


def images(batch=2, size=(56, 56), seed=0, device="cpu"):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------- against timm, float64 referee
#: two blocks in stage 3, not 6 (18 in SwinV2-base): blocks alternate between unshifted and
#: shifted windows, so its third to last blocks run its first two's paths again (CI time)
STAGE3_TWO = dict(depths=(2, 2, 2, 2))
MODEL_CASES = [  # (name, create_model kwargs, image size)
    ("swin_tiny_patch4_window7_224", dict(img_size=112, **STAGE3_TWO), (112, 112)),
    ("swin_tiny_patch4_window7_224", dict(img_size=(96, 128), **STAGE3_TWO), (96, 128)),  # non-square feature maps
    ("swinv2_tiny_window8_256", dict(img_size=128, **STAGE3_TWO), (128, 128)),
    # window_size=7 keeps the model's 224 geometry; at 112 timm would otherwise derive 3x3 windows
    ("swinv2_cr_tiny_224", dict(img_size=112, window_size=7, **STAGE3_TWO), (112, 112)),
    ("swinv2_base_window12to16_192to256", dict(img_size=128, **STAGE3_TWO), (128, 128)),
]


def _run(model, x, train, seed=0):
    model.train(train)
    torch.manual_seed(seed)  # SwinV2-CR's meta_mlp dropout draws the same masks on every side
    out = model(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    (out * g).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# Training mode for every case; eval mode too where it runs different code: a first model
# (the module's mode is read at call time) and SwinV2-CR, whose meta_mlp has dropout. The
# other models have no dropout (drop_path_rate=0), so their eval runs the same kernels as
# their training run, for 40 s to 3 minutes each under the interpreter.
EVAL_TOO = {("swin_tiny_patch4_window7_224", (112, 112)), ("swinv2_cr_tiny_224", (112, 112))}
MODEL_RUNS = [pytest.param(name, kwargs, size, train, id=f"{name}-{size[0]}x{size[1]}-{'train' if train else 'eval'}")
              for name, kwargs, size in MODEL_CASES for train in (False, True)
              if train or (name, size) in EVAL_TOO]


@pytest.mark.parametrize("name,kwargs,size,train", MODEL_RUNS)
def test_patched_model_matches_timm(name, kwargs, size, train):
    """Forward and every parameter gradient of the patched model (float32, the Triton
    kernels) against timm's unpatched model in float32 and in float64, with the rule of
    ``timm-flashwin verify``: the output may be at most twice as far from float64 as
    timm's own float32 arithmetic; a gradient at most GRADIENT_FACTOR times timm's error
    on that tensor or twice timm's error on all gradients together, and all gradients
    together at most GRADIENT_FACTOR times timm's; timm's error is the larger of two
    runs, the second on images moved by one ulp (verify.py says why). (A single
    early-layer gradient carries the rounding of the whole backward chain behind it: the
    first layer's logit-scale gradient of the window-16 SwinV2-base came out 2.1x timm's
    error in the model, while the op alone, fed the same upstream gradient, is at 4e-7
    against float64.)"""
    model = create(name, drop_path_rate=0.0, **kwargs)
    ours = patch_model(copy.deepcopy(model))
    assert len(patch_report(ours).patched) == len(patch_report(ours).modules) > 0
    x = images(1, size)
    ref_out, ref_grads = _run(copy.deepcopy(model).double(), x.double(), train)
    again_out, again_grads = _run(copy.deepcopy(model), jitter_images(x), train)  # timm's second draw of noise
    timm_out, timm_grads = _run(model, x, train)
    our_out, our_grads = _run(ours, x, train)
    checks = [compare("<output>", our_out, timm_out, ref_out, 1e-4, 1e-6, timm_again=again_out)]
    assert our_grads.keys() == timm_grads.keys() == ref_grads.keys() == again_grads.keys()
    floor = larger_error(group_error(timm_grads, ref_grads), group_error(again_grads, ref_grads))
    checks += [compare(n, our_grads[n], timm_grads[n], ref_grads[n], 1e-4, 1e-6, floor, GRADIENT_FACTOR,
                       again_grads[n]) for n in ref_grads]
    # All gradients together: within GRADIENT_FACTOR of timm's, as each single gradient.
    # 2x was too tight for a chaotic model: SwinV2-CR-tiny in eval mode, float32, on the
    # input and three one-ulp jitters of it, measured timm 7.8e-5, 9.5e-5, 1.2e-4, 5.0e-4
    # and the patched model 6.5e-4, 1.1e-4, 6.3e-5, 5.4e-4 against float64 (the same
    # spread; the op alone is as far from float64 as PyTorch's float32 math).
    assert group_error(our_grads, ref_grads) <= max(1e-4, GRADIENT_FACTOR * floor)
    failed = [c for c in checks if not c.passed]
    assert not failed, "\n".join(map(str, failed[:10]))
    # the attention parameters really got gradients through the kernels
    assert any(n.endswith(("relative_position_bias_table", "cpb_mlp.0.weight", "meta_mlp.fc1.weight"))
               for n in our_grads)


def test_non_square_windows_occur():
    """At (96, 128) some stages run windows that are not square (and not a power of two)."""
    model = timm.create_model("swin_tiny_patch4_window7_224", img_size=(96, 128))
    sizes = {tuple(m.window_size) for m in model.modules() if isinstance(m, SWIN_V1)}
    assert any(h != w for h, w in sizes), sizes


def test_every_registered_model_is_fully_patched_on_meta():
    """Every attention module of every swin* model (built on the meta device), strict: 37
    models and 864 modules. One loop, each model built once (a separate count built all 37
    again: CI time)."""
    names = timm.list_models("swin*")
    total = 0
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name)
        patch_model(model, strict=True)
        report = patch_report(model)
        assert report.modules and not report.skipped, name
        assert all(is_patched(m) for m in model.modules() if isinstance(m, (SWIN_V1, SWIN_V2, SWIN_CR))), name
        total += len(report.modules)
    assert len(names) == 37 and total == 864


# ------------------------------------------------------------------------ behaviour
def test_state_dict_unchanged_and_checkpoints_move_freely():
    model = tiny_swin()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model)
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    plain = timm.create_model("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(2, 4),
                              embed_dim=32, num_classes=10)
    plain.load_state_dict(after)  # patched -> unpatched
    other = patch_model(tiny_swin(num_classes=10))
    other.load_state_dict(plain.state_dict())  # unpatched -> patched
    x = images()
    torch.testing.assert_close(other.eval()(x), plain.eval()(x), rtol=1e-5, atol=1e-5)


def test_unpatch_restores_bit_identical_outputs():
    model = tiny_swin().eval().to(KERNEL_DEVICE)
    x = images(device=KERNEL_DEVICE)
    with torch.no_grad():
        expected = model(x)
        patch_model(model)
        patched_out = model(x)
        unpatch_model(model)
        restored = model(x)
    assert not is_patched(model)
    assert torch.equal(restored, expected)
    assert not torch.equal(patched_out, expected)  # the kernels really ran while patched


def test_patching_twice_is_a_no_op():
    model = patch_model(tiny_swin())
    state = {id(m): dict(m.__dict__) for m in model.modules()}
    assert patch_model(model) is model
    assert {id(m): dict(m.__dict__) for m in model.modules()} == state


def test_deepcopy_and_torch_save_stay_patched():
    model = patch_model(tiny_swin()).eval()
    x = images()
    with torch.no_grad():
        expected = model(x)
        clone = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for other in (clone, loaded):
            assert is_patched(other) and len(patch_report(other).patched) == 4
            assert torch.equal(other(x), expected)


def test_context_manager_restores_on_exit_and_on_exception():
    model = tiny_swin()
    with patched(model) as m:
        assert m is model and is_patched(model)
    assert not is_patched(model)
    with pytest.raises(RuntimeError, match="boom"):
        with patched(model):
            assert is_patched(model)
            raise RuntimeError("boom")
    assert not is_patched(model)
    patch_model(model)  # patched before: the context leaves it patched
    with patched(model):
        pass
    assert is_patched(model)


def test_is_patched_for_module_and_model():
    model = tiny_swin()
    attn = model.layers[0].blocks[0].attn
    assert not is_patched(model) and not is_patched(attn)
    patch_model(model, filter_fn=lambda module, name: name == "layers.0.blocks.0.attn")
    assert is_patched(attn) and is_patched(model)
    assert not is_patched(model.layers[1].blocks[0].attn)
    assert not is_patched(nn.Linear(2, 2))


# ------------------------------------------------------------ the blocks around the modules
SWIN_V1_BLOCK = timm.models.swin_transformer.SwinTransformerBlock


def _maps_read_in_place(monkeypatch) -> list:
    """The grids of the block calls whose windows the op read from the feature map (the
    others ran timm's roll, partition, module call, merge and roll back)."""
    grids = []
    real = WindowAttentionAdapter.block_attention

    def spy(self, block, x, grid):
        grids.append(grid)
        return real(self, block, x, grid)

    monkeypatch.setattr(WindowAttentionAdapter, "block_attention", spy)
    return grids


def test_blocks_read_their_windows_from_the_map_until_unpatched(monkeypatch):
    model = tiny_swin().eval()
    ours = patch_model(copy.deepcopy(model))
    blocks = [m for m in ours.modules() if isinstance(m, SWIN_V1_BLOCK)]
    assert [type(b) for b in blocks] == [FlashSwinTransformerBlock] * 4
    grids = _maps_read_in_place(monkeypatch)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-5, atol=1e-6)
    # stage 1: 14 x 14, 2 x 2 windows, the second block shifted; stage 2: one 7 x 7 window, no shift
    assert grids == [WindowGrid(14, 14, (7, 7)), WindowGrid(14, 14, (7, 7), (3, 3)), WindowGrid(7, 7, (7, 7)),
                     WindowGrid(7, 7, (7, 7))]
    unpatch_model(ours)
    assert [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4
    assert not any(BLOCK_GRID_ATTR in b.__dict__ for b in blocks)
    with patched(ours):
        assert type(blocks[0]) is FlashSwinTransformerBlock
    assert type(blocks[0]) is SWIN_V1_BLOCK
    patch_model(ours, filter_fn=lambda module, name: name != "layers.0.blocks.1.attn")
    assert [type(b) for b in blocks] == [FlashSwinTransformerBlock, SWIN_V1_BLOCK] + [FlashSwinTransformerBlock] * 2
    patch_model(ours, feature_map=False)  # the modules patched, every block timm's
    assert is_patched(ours) and [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4
    with patched(ours):
        assert [type(b) for b in blocks] == [FlashSwinTransformerBlock] * 4
    assert [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4 and is_patched(ours)


def autograd_nodes(out: torch.Tensor) -> list:
    """Names of the nodes of ``out``'s autograd graph."""
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


@pytest.mark.parametrize("name, kwargs", [
    ("swin_tiny_patch4_window7_224", dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32)),
    ("swinv2_tiny_window8_256", dict(img_size=64, depths=(2, 2), num_heads=(2, 4), embed_dim=32)),
], ids=["swin", "swinv2"])
def test_training_gathers_the_position_bias_within_the_op(name, kwargs):
    """V1 and SwinV2 modules hand the op their bias table (``TableBias``): in eager training
    one autograd node per attention, none for a gather of its own."""
    model = patch_model(create(name, **kwargs)).train()
    nodes = autograd_nodes(model(images(1, (kwargs["img_size"],) * 2)))
    assert nodes.count("_EagerWindowAttentionBackward") == 4
    assert "_GatherFromTableBackward" not in nodes and "IndexBackward0" not in nodes


def test_training_computes_the_meta_mlp_bias_in_one_node():
    """SwinV2-CR modules compute their meta_mlp bias with ``position_mlp_table`` in eager
    training: one autograd node per attention for it, none of timm's linear layers, ReLU or
    dropout; in eval mode the same values (no dropout) as timm's method."""
    kwargs = dict(img_size=(56, 56), window_size=7, depths=(2, 2), embed_dim=48, num_heads=(3, 6))
    model = create("swinv2_cr_tiny_224", **kwargs)
    ours = patch_model(copy.deepcopy(model)).train()
    nodes = autograd_nodes(ours(images(1, (56, 56))))
    timm_nodes = autograd_nodes(model.train()(images(1, (56, 56))))
    assert nodes.count("_PositionMLPBackward") == 4
    # meta_mlp's two linear layers in each of the 4 modules; its ReLU and dropout are the only ones
    assert nodes.count("AddmmBackward0") == timm_nodes.count("AddmmBackward0") - 8
    assert timm_nodes.count("ReluBackward0") == 4 and "ReluBackward0" not in nodes
    assert not {"NativeDropoutBackward0", "MulBackward0"} & set(nodes)
    from timm_flashwin.adapters.swinv2_cr import SwinV2CRAdapter
    with torch.no_grad():
        expected = model.stages[0].blocks[0].attn.eval()._relative_positional_encodings()[0]
        got = SwinV2CRAdapter().position_bias(ours.stages[0].blocks[0].attn.eval())
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_meta_mlp_training_after_an_inference_mode_call():
    """A SwinV2-CR model in training mode called under torch.inference_mode first (its
    dropout mask's ones then made there), then trained: its meta_mlp gradients are timm's,
    drawn from the same seed."""
    model = create("swinv2_cr_tiny_224", img_size=(56, 56), window_size=7, depths=(2, 2), embed_dim=48,
                   num_heads=(3, 6))
    ours = patch_model(copy.deepcopy(model)).train()
    x = images(1, (56, 56))
    with torch.inference_mode():
        ours(x)
    grad = torch.randn(1, model.num_classes, generator=torch.Generator().manual_seed(1))
    for net in (ours, model.train()):
        torch.manual_seed(1)
        (net(x) * grad).sum().backward()
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        ours_grad = ours.stages[0].blocks[0].attn.meta_mlp.get_parameter(name).grad
        timm_grad = model.stages[0].blocks[0].attn.meta_mlp.get_parameter(name).grad
        assert relative_error(ours_grad, timm_grad) < 1e-4, name


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_padded_maps_and_dynamic_masks(train, monkeypatch):
    """dynamic_img_size: every block builds its mask per call (timm's dynamic_mask). At 84
    x 84 stage 1 is 21 x 21 (3 x 3 windows, read in place), stage 2 11 x 11, which timm
    pads to 14 x 14 (its padded tokens take part in the attention): timm's method."""
    model = tiny_swin(dynamic_img_size=True)
    ours = patch_model(copy.deepcopy(model))
    grids = _maps_read_in_place(monkeypatch)
    x = images(size=(84, 84))
    timm_out, timm_grads = _run(model, x, train)
    our_out, our_grads = _run(ours, x, train)
    assert grids == [WindowGrid(21, 21, (7, 7)), WindowGrid(21, 21, (7, 7), (3, 3))]
    torch.testing.assert_close(our_out, timm_out, rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == timm_grads.keys()
    assert all(relative_error(our_grads[name], grad) < 1e-4 for name, grad in timm_grads.items())


def test_hooked_modules_are_called_by_their_blocks(monkeypatch):
    """A hook on the module (or on every module) would be skipped by reading the map in
    place: that block calls the module, as timm's method does."""
    model = tiny_swin().eval()
    ours = patch_model(copy.deepcopy(model))
    grids = _maps_read_in_place(monkeypatch)
    seen = []
    handle = ours.layers[0].blocks[1].attn.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-5, atol=1e-6)
    assert seen == [(8, 49, 32)] and len(grids) == 3  # 2 images x 4 windows; the other three blocks in place
    handle.remove()
    grids.clear()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        with torch.no_grad():
            ours(x)
    finally:
        handle.remove()
    assert grids == []


def test_compiled_blocks_run_timms_method(monkeypatch):
    """Under torch.compile the blocks keep timm's copies (inductor fuses them): the traced
    method is timm's, calling the patched module."""
    ours = patch_model(tiny_swin()).eval()
    grids = _maps_read_in_place(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(images())
    assert grids == []


def test_report_and_logging(caplog):
    model = tiny_swin()
    with caplog.at_level(logging.DEBUG, logger="timm_flashwin"):
        patch_model(model, filter_fn=lambda module, name: not name.startswith("layers.1"))
    report = patch_report(model)
    assert [m.name for m in report.patched] == ["layers.0.blocks.0.attn", "layers.0.blocks.1.attn"]
    assert {m.reason for m in report.skipped} == {"excluded by filter_fn"}
    summary = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(summary) == 1 and "patched 2 of 4" in summary[0].getMessage()
    assert sum("layers.1.blocks.0.attn" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 1
    d = report.to_dict()
    assert d["model"] == "SwinTransformer" and len(d["modules"]) == 4
    assert "flashwin=swin" in repr(model.layers[0].blocks[0].attn)
    assert "flashwin" not in repr(model.layers[1].blocks[0].attn)


def test_nothing_to_patch():
    with pytest.warns(UserWarning, match="ResNet has no timm window-attention"):
        patch_model(timm.create_model("resnet18"))
    with pytest.raises(ValueError, match="ResNet"):
        patch_model(timm.create_model("resnet18"), strict=True)


def test_attention_dropout_runs_in_the_kernel(monkeypatch):
    """attn_drop > 0: the kernels apply it in training mode (p read from the module at
    call time), not in eval mode, and torch.manual_seed reproduces a training step."""
    model = tiny_swin(attn_drop_rate=0.1)
    timm_model = copy.deepcopy(model)
    patch_model(model, strict=True)
    assert len(patch_report(model).patched) == 4
    import timm_flashwin.adapters.base as base
    real, calls = base.window_attention, []
    monkeypatch.setattr(base, "window_attention", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    with torch.no_grad():
        evaluated = model.eval()(images())
    torch.testing.assert_close(evaluated, timm_model.eval()(images()), rtol=1e-4, atol=1e-5)
    assert calls == [0.0] * 4
    steps = []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(5)
        out = model.train()(images())
        out.square().sum().backward()
        steps.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    assert calls[4:] == [0.1] * 8
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert not torch.allclose(steps[0][0], evaluated, rtol=1e-3, atol=1e-3)  # dropout did something
    model.layers[0].blocks[0].attn.attn_drop.p = 0.0  # read at call time
    calls.clear()
    model(images())
    assert calls == [0.0, 0.1, 0.1, 0.1]


def test_attention_dropout_of_one_is_skipped_with_reason():
    model = patch_model(tiny_swin(attn_drop_rate=1.0))
    assert {m.reason for m in patch_report(model).skipped} == {"attn_drop=1.0 is not in [0, 1)"}
    with pytest.raises(PatchError, match="attn_drop=1.0"):
        patch_model(tiny_swin(attn_drop_rate=1.0), strict=True)


def test_unsupported_head_dim_is_skipped_with_reason():
    model = tiny_swin(num_heads=(2, 8), embed_dim=528)  # head_dim 264, then 132
    patch_model(model)
    reasons = {m.name: m.reason for m in patch_report(model).skipped}
    assert reasons == {"layers.0.blocks.0.attn": "head_dim 264 is not in [1, 256]",
                       "layers.0.blocks.1.attn": "head_dim 264 is not in [1, 256]"}
    assert len(patch_report(model).patched) == 2
    with pytest.raises(PatchError) as info:
        patch_model(tiny_swin(num_heads=(2, 8), embed_dim=528), strict=True)
    assert set(info.value.reasons) == set(reasons)
    x = images()
    with torch.no_grad():
        ref = copy.deepcopy(model)
        unpatch_model(ref)
        torch.testing.assert_close(model.eval()(x), ref.eval()(x), rtol=1e-4, atol=1e-5)


def test_timm_version_without_expected_attribute(monkeypatch):
    monkeypatch.setattr(ADAPTERS["swin"], "required", ADAPTERS["swin"].required + ("attribute_of_another_timm",))
    model = tiny_swin()
    patch_model(model)
    assert not is_patched(model)
    assert all(f"timm {timm.__version__}: the module has no attribute_of_another_timm" == m.reason
               for m in patch_report(model).skipped)


def test_subclass_is_left_to_timm():
    class MyAttention(SWIN_V1):
        pass

    model = tiny_swin()
    old = model.layers[0].blocks[0].attn
    new = MyAttention(32, 2, window_size=7)
    new.load_state_dict(old.state_dict())
    model.layers[0].blocks[0].attn = new
    patch_model(model)
    assert patch_report(model).skipped[0].reason.startswith("MyAttention subclasses timm's class")


def test_bad_input_to_patched_module():
    attn = patch_model(tiny_swin()).layers[0].blocks[0].attn
    with pytest.raises(ValueError, match=r"expected N = 7\*7 = 49 tokens per window, got 48"):
        attn(torch.randn(4, 48, 32))
    with pytest.raises(ValueError, match="expected C = 32 channels, got 16"):
        attn(torch.randn(4, 49, 16))
    with pytest.raises(ValueError, match="shape"):
        attn(torch.randn(49, 32))


def test_parameters_are_read_at_call_time():
    """Optimizer steps and in-place edits after patching take effect (also through the
    inference cache of the SwinV2 bias)."""
    model = create("swinv2_tiny_window8_256", img_size=64, depths=(2, 2), num_heads=(2, 4), embed_dim=32,
                   num_classes=10, drop_path_rate=0.0)
    ours = patch_model(copy.deepcopy(model))
    x = images(1, (64, 64))
    with torch.no_grad():
        before = ours.eval()(x)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    ours.train()(x).square().mean().backward()
    opt.step()  # the patched model's own optimizer step...
    model.load_state_dict(ours.state_dict())  # ...and timm with the same parameters
    with torch.no_grad():
        after = ours.eval()(x)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, model.eval()(x), rtol=1e-4, atol=1e-5)
        for net in (model, ours):  # in place, between two cached inference calls
            net.layers[0].blocks[0].attn.cpb_mlp[0].weight.mul_(1.5)
            net.layers[1].blocks[1].attn.logit_scale.add_(0.3)
        torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-5)
        ours.load_state_dict(perturb_(copy.deepcopy(model), seed=3).state_dict())
        model.load_state_dict(ours.state_dict())
        torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-5)


def test_dtype_moves_and_set_input_size():
    model = tiny_swin()
    ours = patch_model(copy.deepcopy(model))
    x = images(1, (56, 56))
    with torch.no_grad():
        ours.double()
        model.double()
        torch.testing.assert_close(ours.eval()(x.double()), model.eval()(x.double()))  # float64 runs in PyTorch
        ours.float()
        model.float()
        model.set_input_size(img_size=(112, 112))
        ours.set_input_size(img_size=(112, 112))
        assert is_patched(ours)
        y = images(1, (112, 112))
        torch.testing.assert_close(ours(y), model(y), rtol=1e-4, atol=1e-5)


def test_features_only_and_user_module_and_ddp(tmp_path, monkeypatch):
    feats = create("swin_tiny_patch4_window7_224", features_only=True, img_size=56, depths=(2, 2),
                   num_heads=(2, 4), embed_dim=32, out_indices=(0, 1))
    ours = patch_model(copy.deepcopy(feats))
    assert len(patch_report(ours).patched) == 4
    x = images()
    with torch.no_grad():
        for a, b in zip(ours.eval()(x), feats.eval()(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = tiny_swin()
            self.head = nn.Linear(10, 2)

        def forward(self, x):
            return self.head(self.backbone(x))

    wrapped = patch_model(Wrapper())
    assert len(patch_report(wrapped).patched) == 4 and patch_report(wrapped).model == "Wrapper"

    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    # init_process_group prefixes sys.excepthook's tracebacks with "[rank0]: " for good: restored after the test
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        ddp = nn.parallel.DistributedDataParallel(tiny_swin())
        patch_model(ddp)
        assert len(patch_report(ddp).patched) == 4
        ddp(x).sum().backward()
        assert ddp.module.layers[0].blocks[0].attn.relative_position_bias_table.grad is not None
    finally:
        dist.destroy_process_group()


def recording_backend(graphs, inner="aot_eager"):
    """A torch.compile backend that keeps each graph's call targets, then compiles."""
    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)
    return backend


def flashwin_ops(graphs):
    """Calls of the attention operator (the bias gather's operators, in training graphs of
    V1 and SwinV2 models, are not counted)."""
    return sum("timm_flashwin.window_attention" in t for g in graphs for t in g)


def test_compiles_whole_model_without_graph_break():
    """dynamo traces the patched modules in one graph, and the graph calls the op (a
    graph with timm's softmax instead would be numerically close: compare the graph)."""
    model = patch_model(tiny_swin()).eval().to(KERNEL_DEVICE)  # where the kernels run
    plain = unpatch_model(copy.deepcopy(model))
    x = images(device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs = []
    with torch.no_grad():
        torch.compile(plain, fullgraph=True, backend=recording_backend(graphs))(x)
        assert flashwin_ops(graphs) == 0
        out = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))(x)  # same code, new class
        assert len(graphs) == 2 and flashwin_ops(graphs[1:]) == 4
        assert not any("softmax" in t for t in graphs[1])
        assert torch.equal(out, model(x))



def test_compiled_cr_training_computes_the_meta_mlp_bias_with_the_operators():
    """Under torch.compile(fullgraph=True), a SwinV2-CR training step computes each module's
    meta_mlp bias with the registered position-MLP operator (one graph, no break), its
    dropout drawn in the graph (aot_eager keeps PyTorch's random numbers): the output and
    every gradient of the eager patched model."""
    model = patch_model(create("swinv2_cr_tiny_224", img_size=(56, 56), window_size=7, depths=(2, 2),
                               embed_dim=48, num_heads=(3, 6))).train().to(KERNEL_DEVICE)
    x = images(device=KERNEL_DEVICE)
    grad = torch.randn(2, model.num_classes, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = net(x)
        (out * grad).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(graphs) == 1 and sum("timm_flashwin.position_mlp_table" in t for t in graphs[0]) == 4
    (compiled_out, compiled_grads), (eager_out, eager_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
    assert all(relative_error(compiled_grads[n], g) < 1e-5 for n, g in eager_grads.items())

def test_why_not_wrapt():
    """Why patching swaps classes instead of wrapping timm's forward with wrapt (as first
    designed): a module whose class forward is a wrapt wrapper, called from its parent,
    runs the wrapper in eager mode but not under torch.compile, where dynamo calls the
    wrapped function instead, silently. The same module patched by a subclass whose
    forward is a plain method is traced as written. If the wrapt half of this test ever
    fails, dynamo has started calling wrapt wrappers and wrapt could be reconsidered."""
    wrapt = pytest.importorskip("wrapt")

    class Attention(nn.Module):
        def forward(self, x):
            return x.softmax(-1)

    def route(wrapped, instance, args, kwargs):  # what a wrapt-based patch would do
        return torch.sigmoid(args[0])

    class WraptPatched(Attention):
        forward = wrapt.FunctionWrapper(Attention.forward, route)

    class SubclassPatched(Attention):
        def forward(self, x):
            return torch.sigmoid(x)

    class Parent(nn.Module):
        def __init__(self, patched_class):
            super().__init__()
            self.attn = Attention()
            self.attn.__class__ = patched_class

        def forward(self, x):
            return self.attn(x) * 2

    x = torch.randn(3, 5)
    for patched_class, dynamo_runs_the_patch in ((WraptPatched, False), (SubclassPatched, True)):
        torch._dynamo.reset()
        graphs = []
        model = Parent(patched_class)
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))(x)
        torch.testing.assert_close(model(x), torch.sigmoid(x) * 2)  # eager runs the patch either way
        assert any("sigmoid" in t for t in graphs[0]) == dynamo_runs_the_patch, (patched_class.__name__, graphs)
        expected = torch.sigmoid(x) if dynamo_runs_the_patch else x.softmax(-1)
        torch.testing.assert_close(compiled, expected * 2)

# ------------------------------------------------------------------------ GPU only
GPU_MODELS = ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224",
              "swinv2_base_window12to16_192to256"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GPU_MODELS)
def test_gpu_full_resolution_autocast(name, dtype):
    """Full resolution, AMP (autocast, float32 weights), forward and every gradient:
    the patched model at most twice as far from float64 as timm itself, or within
    the dtype's tolerance."""
    from timm_flashwin.verify import verify_model
    result = verify_model(name, batch=2, dtype="bfloat16" if dtype == torch.bfloat16 else "float16",
                          device="cuda", train=True)
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.backend == "triton"
    # perturbed models are chaotic in low precision: top-1 is judged against timm's own
    assert result.top1_ours_vs_float64 >= result.top1_timm_vs_float64 - 0.5


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224"])
def test_gpu_torch_compile_inference_and_training(name):
    """torch.compile(fullgraph=True) of a patched model: inference and a training step
    give what the eager patched model gives (float32, so that only inductor's fusions
    of the surrounding ops differ)."""
    torch._dynamo.reset()
    # SwinV2-CR's meta_mlp has dropout in training: inductor draws its own random numbers
    # unless told to use eager's, and both runs below start from the same seed.
    torch._inductor.config.fallback_random = True
    eager = patch_model(create(name, drop_path_rate=0.0)).cuda()
    compiled_src = copy.deepcopy(eager)
    graphs = []
    compiled = torch.compile(compiled_src, fullgraph=True, backend=recording_backend(graphs, "inductor"))
    x = images(4, eager.pretrained_cfg["input_size"][1:], device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(x), eager.eval()(x), rtol=1e-3, atol=1e-3)
    losses = []
    for net, params in ((compiled.train(), compiled_src), (eager.train(), eager)):
        opt = torch.optim.SGD(params.parameters(), lr=1e-3)
        torch.manual_seed(0)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isclose(*losses, rel_tol=1e-3)
    assert graphs and all(flashwin_ops([g]) == len(patch_report(eager).patched) for g in graphs)
    grads = dict(eager.named_parameters())
    for n, p in compiled_src.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        c = compare(n, p.grad, grads[n].grad, grads[n].grad, 1e-2, 1e-5)
        # SwinV2-CR's meta_mlp.fc2.bias has an exactly-zero true gradient (|g| ~ 1e-8): absolute
        assert c.err_ours < 5e-2 or c.max_abs < 1e-6, (n, c)


@pytest.mark.cuda
def test_gpu_torch_compile_recompute_qkv():
    """patch_model(recompute_qkv=True) under torch.compile(fullgraph=True), AMP bf16: a
    training step gives the plain patched model's loss and gradients, at a lower peak
    memory (the qkv projections' outputs, recomputed in the backward, are not kept); so
    does recompute_qkv for the second stage's modules only, by at least their share."""
    name, batch = "swin_tiny_patch4_window7_224", 16
    x = images(batch, (224, 224), device="cuda")
    runs = []
    for recompute in (False, True, lambda module, qualified_name: qualified_name.startswith("layers.1.")):
        torch._dynamo.reset()
        model = patch_model(create(name, drop_path_rate=0.0), recompute_qkv=recompute).cuda().train()
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # the first step compiles; the second is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(x).float().square().mean()
            loss.backward()
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        runs.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}, peak))
        del compiled, model
    (plain_loss, plain_grads, plain_peak), *recomputed = runs
    # the qkv outputs, (B_, N, 3 C) bf16 per block, of swin_tiny's (2, 2, 6, 2) blocks, per stage
    qkv_bytes = [depth * batch * (56 // 2 ** s) ** 2 * 3 * 96 * 2 ** s * 2 for s, depth in enumerate((2, 2, 6, 2))]
    for (loss, grads, peak), freed in zip(recomputed, (sum(qkv_bytes), qkv_bytes[1])):
        assert math.isclose(loss, plain_loss, rel_tol=1e-3)
        for n, g in grads.items():
            assert (g - plain_grads[n]).norm() <= 2e-2 * plain_grads[n].norm() + 1e-6, n
        assert plain_peak - peak >= 0.5 * freed, (plain_peak, peak, freed)


def test_compiled_model_follows_recompute_qkv():
    """A compiled patched model recompiles when patch_model turns recompute_qkv on or off:
    the training graph then holds a checkpointed region (the qkv projection and the op)
    or not."""
    model = patch_model(tiny_swin()).train().to(KERNEL_DEVICE)
    x = images(device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))
    checkpointed = []
    for recompute in (False, True, False):
        patch_model(model, recompute_qkv=recompute)
        before = len(graphs)
        compiled(x).sum().backward()
        checkpointed.append([any("checkpoint" in t for t in g) for g in graphs[before:]])
    assert checkpointed == [[False], [True], []]  # the last call reuses the first graph
