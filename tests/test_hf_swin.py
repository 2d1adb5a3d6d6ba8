"""Hugging Face transformers' Swin family (timm_flashwin/adapters/hf_*.py): the patched
models against transformers' own unpatched ones, float64 as the referee, and the patcher's
promises for them. Tiny models (tests/hf_cases.py) through the Triton interpreter on CPU.

These run with the transformers installed (5.x in CI). ``test_transformers4`` runs this
file again in a subprocess on a 4.x transformers (the "self_output" layout for every
family, head masks), where the environment names one (TIMM_FLASHWIN_TRANSFORMERS4).
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_cases import FAMILIES, config, counting_op_calls, image_size, tiny_model  # noqa: E402
from model_cases import images  # noqa: E402
from model_checks import (compiled_against_timm, full_resolution_passes, judge, patched_in_place,  # noqa: E402
                          training_step_runs)
from opcases import relative_error  # noqa: E402
from timm_flashwin import PatchError, patch_model, patch_report  # noqa: E402
from timm_flashwin.tools.hf_models import HF_PREFIX  # noqa: E402

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
#: where a transformers 4.x is installed (pip install --target), for test_transformers4
TRANSFORMERS4_ENV = "TIMM_FLASHWIN_TRANSFORMERS4"
#: the tests test_transformers4 runs there (-k): the layout-dependent ones, on the CPU
TRANSFORMERS4_TESTS = ("(training_step or output_attentions or head_mask or unknown_layout or filter_fn) "
                       "and not sdpa and not gpu")

#: (family, attention implementation): 5.x's SwinAttention calls either interface; the
#: other families' modules (and every 4.x one) compute eagerly, whatever the config says
CASES = [("hf_swin", "eager"), ("hf_swin", "sdpa"), ("hf_swinv2", ""), ("hf_donut_swin", ""),
         ("hf_maskformer_swin", ""), ("hf_swin2sr", "")]
CASE_IDS = [f"{family}-{implementation}" if implementation else family for family, implementation in CASES]
#: the bias source of each family's attention: its gradient must come through the op
BIAS_SOURCES = {"hf_swin": ("relative_position_bias_table",), "hf_donut_swin": ("relative_position_bias_table",),
                "hf_maskformer_swin": ("relative_position_bias_table",),
                "hf_swinv2": ("logit_scale", "continuous_position_bias_mlp"),
                "hf_swin2sr": ("logit_scale", "continuous_position_bias_mlp")}
#: the key projection's bias: softmax does not depend on it, its gradient is 0 up to rounding
#: (judged against float64 by ``judge`` alone)
KEY_BIASES = ("key.bias", "k_proj.bias")


@pytest.mark.parametrize("family, implementation", CASES, ids=CASE_IDS)
def test_training_step_matches_transformers(family, implementation, monkeypatch):
    """A training step of the patched model (float32, the kernels through the interpreter)
    against transformers' (``training_step_matches``)."""
    training_step_matches(family, implementation, "cpu", monkeypatch)


def training_step_matches(family: str, implementation: str, device: str, monkeypatch) -> None:
    """A training step of the patched tiny model against transformers' on ``device``: output
    within 2e-4 and every parameter gradient within 1e-3 relative, and verify's rule against
    a float64 copy (the patched error at most that of transformers' own float32)."""
    model = tiny_model(family, implementation if TRANSFORMERS_5 else "").to(device)
    ours = patch_model(copy.deepcopy(model), strict=True)
    op_calls = counting_op_calls(monkeypatch)
    runs = training_step_runs(model, ours, images(2, (image_size(family),) * 2, device=device))
    assert op_calls() == len(patch_report(ours).patched) == 2
    (our_out, our_grads), (their_out, their_grads) = runs[:2]
    assert relative_error(our_out, their_out) < 2e-4
    errors = {name: relative_error(grad, their_grads[name]) for name, grad in our_grads.items()
              if not name.endswith(KEY_BIASES)}
    assert max(errors.values()) < 1e-3, sorted(errors.items(), key=lambda item: -item[1])[:5]
    attention = {name: grad for name, grad in our_grads.items() if ".attention." in name}
    assert all(any(source in name for name in attention) for source in BIAS_SOURCES[family])
    assert all(grad.abs().sum() > 0 for name, grad in attention.items() if not name.endswith(KEY_BIASES))
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))


@pytest.mark.cuda
@pytest.mark.parametrize("family, implementation", CASES, ids=CASE_IDS)
def test_training_step_matches_transformers_gpu(family, implementation, monkeypatch):
    """The same on the GPU."""
    training_step_matches(family, implementation, "cuda", monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize("family, implementation", CASES, ids=CASE_IDS)
def test_compiled_matches_transformers_gpu(family, implementation):
    """torch.compile(fullgraph=True) of the patched tiny model: one op call per module in
    every graph, eval output and a training step's gradients judged against transformers'."""
    failed = compiled_against_timm(tiny_model(family, implementation if TRANSFORMERS_5 else ""))
    assert not failed, "\n".join(map(str, failed))


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["swin", "swinv2", "donut-swin", "maskformer-swin",
                                  "swin2sr:Swin2SRForImageSuperResolution"])
def test_default_configs_bfloat16_gpu(spec):
    """Each family's default config (swin-tiny's for Swin, 224x224; Swin2SR's 64x64), AMP
    bfloat16 training through verify (``full_resolution_passes``)."""
    full_resolution_passes(HF_PREFIX + spec, "bfloat16")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_pickling_and_unpatch(family):
    """Patched in place: the state_dict unchanged, a deepcopy and a torch.save / torch.load
    patched alike, and unpatching gives transformers' output back bit for bit."""
    model = tiny_model(family).eval()
    x = images(1, (image_size(family),) * 2)
    with patched_in_place(model, x, patched=2) as (expected, patched_out):
        torch.testing.assert_close(patched_out, expected, rtol=2e-4, atol=1e-5)
        patched = [m for m in model.modules() if type(m).__module__ == "timm_flashwin.patching.hf"]
        assert len(patched) == 2 and all(f"flashwin={family}" in repr(m) for m in patched)


def test_output_attentions_keeps_transformers_path(monkeypatch):
    """Attention weights asked for, by the call or (5.x) by the config: transformers' own
    forward runs for that call and returns them; without, the op runs."""
    for family in ("hf_swin", "hf_swinv2"):
        model = tiny_model(family, "eager").model.eval()
        x = images(1, (image_size(family),) * 2)
        with torch.no_grad():
            expected = model(x, output_attentions=True).attentions
            patch_model(model, strict=True)
            op_calls = counting_op_calls(monkeypatch)
            got = model(x, output_attentions=True).attentions
            assert op_calls() == 0 and len(got) == len(expected) > 0
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            model.config.output_attentions = True
            assert len(model(x).attentions) == len(expected) and op_calls() == 0
            model.config.output_attentions = False
            assert model(x).attentions is None and op_calls() == 2
        monkeypatch.undo()


@pytest.mark.skipif(TRANSFORMERS_5, reason="transformers 5.x has no head masks")
def test_head_mask_keeps_transformers_path(monkeypatch):
    """4.x: a head mask, which the op does not take, sends the call to transformers' forward
    (on the module: 4.x's stages index the model's head mask by block, out of range past
    the first block)."""
    for family in ("hf_swin", "hf_swinv2"):
        model = tiny_model(family).model.eval()
        attention = model.base_model.encoder.layers[0].blocks[0].attention
        windows, head_mask = torch.randn(4, 16, 16), torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
        with torch.no_grad():
            expected = attention(windows, None, head_mask)[0]
            patch_model(model, strict=True)
            op_calls = counting_op_calls(monkeypatch)
            assert torch.equal(attention(windows, None, head_mask)[0], expected) and op_calls() == 0
            attention(windows, None)
            assert op_calls() == 1
        monkeypatch.undo()


@pytest.mark.skipif(not TRANSFORMERS_5, reason="the attention interface is 5.x's")
def test_other_attention_interface_keeps_transformers_path(monkeypatch):
    """5.x's SwinAttention with an attention function registered with transformers (not
    eager or SDPA, whose math the op computes): that function runs, not the op."""
    from transformers import AttentionInterface
    from transformers.models.swin.modeling_swin import eager_attention_forward
    used = []

    def counting_attention(*args, **kwargs):
        used.append(1)
        return eager_attention_forward(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flashwin_test_counting", counting_attention)
    model = patch_model(tiny_model("hf_swin").model.eval(), strict=True)
    model.config._attn_implementation = "flashwin_test_counting"
    op_calls = counting_op_calls(monkeypatch)
    with torch.no_grad():
        model(images(1, (16, 16)))
    assert len(used) == 2 and op_calls() == 0


def test_unknown_layout_is_reported_not_guessed():
    """A module in neither layout (another release's) keeps transformers' forward, with the
    reason in the report; strict mode raises it."""
    model = tiny_model("hf_swin").model
    attention = model.swin.encoder.layers[0].blocks[1].attention
    projection = "q_proj" if hasattr(attention, "q_proj") else "self"
    delattr(attention, projection)
    patch_model(model)
    report = patch_report(model)
    assert len(report.patched) == 1 and len(report.skipped) == 1
    assert report.skipped[0].reason.startswith(f"transformers {transformers.__version__}: SwinAttention has neither "
                                               "layout")
    with pytest.raises(PatchError, match="has neither layout"):
        patch_model(model, strict=True)


def test_filter_fn_and_headed_models():
    """filter_fn skips the modules it names; the families' modules are found under other
    heads: Donut's VisionEncoderDecoderModel, MaskFormer's segmentation model, Swin's
    backbone."""
    model = patch_model(tiny_model("hf_swinv2").model, filter_fn=lambda module, name: "blocks.0." not in name)
    assert [s.reason for s in patch_report(model).skipped] == ["excluded by filter_fn"]
    decoder = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, is_decoder=True, add_cross_attention=True)
    headed = {
        "VisionEncoderDecoderModel": transformers.VisionEncoderDecoderModel(
            transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(config("hf_donut_swin"), decoder)),
        "MaskFormerForInstanceSegmentation": transformers.MaskFormerForInstanceSegmentation(
            transformers.MaskFormerConfig(backbone_config=config("hf_maskformer_swin", out_features=["stage1"]),
                                          decoder_config=dict(model_type="detr", encoder_layers=1, decoder_layers=1,
                                                              d_model=16, encoder_attention_heads=2,
                                                              decoder_attention_heads=2, encoder_ffn_dim=16,
                                                              decoder_ffn_dim=16, num_queries=4),
                                          fpn_feature_size=32, mask_feature_size=32)),
        "SwinBackbone": transformers.SwinBackbone(config("hf_swin", out_features=["stage1"])),
    }
    for name, headed_model in headed.items():
        patch_model(headed_model, strict=True)
        assert len(patch_report(headed_model).patched) == 2, name


def test_transformers4():
    """This file's tests of the layout-dependent behaviour again on a transformers 4.x (its
    "self_output" layout for Swin too, head masks), in a subprocess whose path puts it first."""
    where = os.environ.get(TRANSFORMERS4_ENV)
    if not where or not (Path(where) / "transformers").is_dir():
        pytest.skip(f"{TRANSFORMERS4_ENV} does not name a directory holding transformers 4.x (.ci/run installs one: "
                    "pip install --no-deps --target DIR 'transformers==4.57.*' 'tokenizers==0.22.*' "
                    "'huggingface_hub<1.0')")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([where, str(root), os.environ.get("PYTHONPATH", "")]))
    env.pop(TRANSFORMERS4_ENV)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "--override-ini=addopts=", __file__, "-k", TRANSFORMERS4_TESTS],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]  # head masks' test ran
    assert "transformers 4." in subprocess.run(
        [sys.executable, "-c", "import transformers; print('transformers', transformers.__version__)"],
        env=env, capture_output=True, text=True).stdout
