"""What a patched model reports and when it keeps timm's forward: the report and logging,
nothing to patch, attention dropout, modules skipped with a reason (dropout of one, head
dims, a timm version without an attribute, subclasses), bad input, parameters read at call
time, dtype moves and set_input_size, features_only, user modules and DDP."""
import copy
import logging
import os
import sys

import pytest
import timm
import torch
from torch import nn

from model_cases import create, images, tiny_swin
from timm_flashwin import PatchError, is_patched, patch_model, patch_report, unpatch_model
from timm_flashwin.patching.adapters import ADAPTERS
from timm_flashwin.tools.verify import perturb_


SWIN_V1 = timm.models.swin_transformer.WindowAttention


def test_report_and_logging(caplog):
    """The summary is logged once per patch_model call: at INFO where the only modules left
    to timm are filter_fn's choices (a WARNING at every call was noise), at WARNING where
    some cannot be served. The report says what computes the patched attention here."""
    model = tiny_swin()
    with caplog.at_level(logging.DEBUG, logger="timm_flashwin"):
        patch_model(model, filter_fn=lambda module, name: not name.startswith("layers.1"))
    report = patch_report(model)
    assert [m.name for m in report.patched] == ["layers.0.blocks.0.attn", "layers.0.blocks.1.attn"]
    assert {m.reason for m in report.skipped} == {"excluded by filter_fn"}
    summary = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(summary) == 1 and "patched 2 of 4" in summary[0].getMessage() and summary[0].levelno == logging.INFO
    road = {"cpu": "triton-interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "pytorch"}
    assert report.road == road.get(next(model.parameters()).device.type, "triton")
    assert str(report).splitlines()[1] == report.road_line() and report.road_line().startswith("attention computed by ")
    assert report.to_dict()["road"] == report.road
    assert patch_report(unpatch_model(copy.deepcopy(model))).road is None  # nothing patched: nothing computes
    assert sum("layers.1.blocks.0.attn" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 1
    d = report.to_dict()
    assert d["model"] == "SwinTransformer" and len(d["modules"]) == 4
    assert "flashwin=swin" in repr(model.layers[0].blocks[0].attn)
    assert "flashwin" not in repr(model.layers[1].blocks[0].attn)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="timm_flashwin"):
        patch_model(tiny_swin(), filter_fn=lambda module, name: name != "layers.1.blocks.0.attn")
        patch_model(tiny_swin(), filter_fn=lambda module, name: False)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]


def test_nothing_to_patch():
    with pytest.warns(UserWarning, match="ResNet has no timm window-attention"):
        patch_model(timm.create_model("resnet18"))
    with pytest.raises(PatchError, match="ResNet has no timm window-attention module to patch") as info:
        patch_model(timm.create_model("resnet18"), strict=True)
    assert isinstance(info.value, ValueError) and info.value.reasons == {}


def test_attention_dropout_runs_in_the_kernel(monkeypatch):
    """attn_drop > 0: the kernels apply it in training mode (p read from the module at
    call time), not in eval mode, and torch.manual_seed reproduces a training step."""
    model = tiny_swin(attn_drop_rate=0.1)
    timm_model = copy.deepcopy(model)
    patch_model(model, strict=True)
    assert len(patch_report(model).patched) == 4
    import timm_flashwin.patching.adapters.base as base
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


def test_attention_dropout_of_one_is_skipped_with_reason(caplog):
    with caplog.at_level(logging.INFO, logger="timm_flashwin"):
        model = patch_model(tiny_swin(attn_drop_rate=1.0))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # a module it cannot serve: a warning
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


def test_strict_counts_only_what_filter_fn_did_not_exclude():
    """strict=True with a filter_fn: modules opted out on purpose are no failure; the ones
    the op cannot serve and the filter kept still are."""
    unservable = dict(num_heads=(2, 8), embed_dim=528)  # layers.0: head_dim 264
    model = patch_model(tiny_swin(**unservable), strict=True, filter_fn=lambda module, name: name.startswith("layers.1"))
    assert [m.name for m in patch_report(model).patched] == ["layers.1.blocks.0.attn", "layers.1.blocks.1.attn"]
    assert {m.reason for m in patch_report(model).skipped} == {"excluded by filter_fn"}
    with pytest.raises(PatchError) as info:
        patch_model(tiny_swin(**unservable), strict=True, filter_fn=lambda module, name: name.startswith("layers.0"))
    assert info.value.reasons == {"layers.0.blocks.0.attn": "head_dim 264 is not in [1, 256]",
                                  "layers.0.blocks.1.attn": "head_dim 264 is not in [1, 256]"}


def test_a_model_name_instead_of_a_model():
    name = "swin_tiny_patch4_window7_224"
    for function in (patch_model, unpatch_model, patch_report, is_patched):
        with pytest.raises(TypeError, match=r"expects a torch.nn.Module, got str; build the model first, "
                                            r"e.g. timm.create_model\('swin_tiny_patch4_window7_224'\)"):
            function(name)
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got OrderedDict"):
        patch_model(tiny_swin().state_dict())


def test_the_readme_shows_patch_models_signature():
    """The README states patch_model's options as keyword-only, with their defaults."""
    import inspect
    from pathlib import Path
    parameters = list(inspect.signature(patch_model).parameters.values())
    assert parameters[0].name == "model" and all(p.kind is p.KEYWORD_ONLY for p in parameters[1:])
    options = ", ".join(f"{p.name}={p.default!r}" for p in parameters[1:])
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert f"`patch_model(model, *, {options})`" in readme


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
