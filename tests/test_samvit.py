"""SAM's image encoder and ViTDet (patching/adapters/samvit.py, hf_sam.py, decomposed.py):
timm's ``samvit`` models and transformers' SamVisionModel (eager and SDPA), SAM-HQ's and
VitDetModel patched, against their unpatched selves with float64 as the referee (verify's
rule), through the interpreter on tiny models: window blocks over a map that fills its
windows and one that is padded, global blocks, a model run at another size than its tables
were made for; the patcher's promises (state_dict, unpatch, report, strict). Full-size GPU
runs are the ``cuda`` cases."""
import copy

import pytest
import torch

from model_cases import images
from model_checks import full_resolution_passes, judge, patched_in_place, training_step_runs
from timm_flashwin import PatchError, patch_model, patch_report
from timm_flashwin.tools.verify import perturb_


def tiny_samvit(img_size=32, window=3, use_rel_pos=True, qk_norm=False, seed=0):
    """A 2-block SAM encoder: 8 x 8 tokens of 16 channels, block 0 in windows of ``window``
    (3: the map padded to 9 x 9; 4: filled), block 1 global; perturbed, train mode."""
    from timm.models.vision_transformer_sam import VisionTransformerSAM
    torch.manual_seed(seed)
    model = VisionTransformerSAM(img_size=img_size, patch_size=4, embed_dim=32, depth=2, num_heads=2, window_size=window,
                                 global_attn_indexes=(1,), use_rel_pos=use_rel_pos, qk_norm=qk_norm, neck_chans=16,
                                 num_classes=0, global_pool="")
    with torch.no_grad():
        perturb_(model, seed)
    return model.train()


def passes_training_step(model, ours, size):
    runs = training_step_runs(model, ours, images(2, size))
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))
    attention = {n: g for n, g in runs[0][1].items() if ".attn" in n or ".attention." in n}
    assert any("rel_pos_h" in n for n in attention) and all(g.abs().sum() > 0 for g in attention.values())


@pytest.mark.parametrize("window, qk_norm", [(3, False), (4, True)], ids=["padded-windows", "filled-windows-qk-norm"])
def test_timm_training_step(window, qk_norm):
    model = tiny_samvit(window=window, qk_norm=qk_norm)
    ours = patch_model(copy.deepcopy(model), strict=True)
    report = patch_report(ours)
    assert [m.layout for m in report.modules] == [f"window {window}x{window}", "global 8x8"]
    passes_training_step(model, ours, (32, 32))


def test_timm_at_another_size_than_built():
    """Built for 32 px, run at 40: the global block's tables interpolated by timm's get_rel_pos."""
    model = tiny_samvit()
    passes_training_step(model, patch_model(copy.deepcopy(model), strict=True), (40, 40))


def test_timm_state_dict_unpatch_and_reasons():
    model = tiny_samvit().eval()
    with patched_in_place(model, images(1, (32, 32)), 2) as (expected, patched_out):
        assert ((patched_out - expected).norm() / expected.norm()).item() < 1e-4
    plain = tiny_samvit(use_rel_pos=False)
    with pytest.raises(PatchError, match="use_rel_pos=False"):
        patch_model(plain, strict=True)
    skipped = patch_report(patch_model(plain)).skipped  # reported (no tables to describe), not a crash
    assert skipped and all("use_rel_pos=False" in m.reason and m.layout is None for m in skipped)


transformers = pytest.importorskip("transformers")


def hf_model(kind, implementation="eager", seed=0):
    """A tiny transformers model of ``kind`` ("sam", "sam_hq", "vitdet"), called as timm models
    are (images -> first output): 8 x 8 tokens, block 0 in windows of 3, block 1 global."""
    from timm_flashwin.tools.hf_models import HfImageModel
    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4,
                  qkv_bias=True, window_size=3)
    if kind == "vitdet":
        config = transformers.VitDetConfig(**common, window_block_indices=[0], use_relative_position_embeddings=True,
                                           mlp_ratio=2, drop_path_rate=0.0)
        model = transformers.VitDetModel._from_config(config)
    else:
        config_class, model_class = (("SamVisionConfig", "SamVisionModel") if kind == "sam"
                                     else ("SamHQVisionConfig", "SamHQVisionModel"))
        config = getattr(transformers, config_class)(**common, global_attn_indexes=[1], use_rel_pos=True,
                                                     output_channels=16, mlp_dim=64, attention_dropout=0.0)
        model = getattr(transformers, model_class)._from_config(config, attn_implementation=implementation)
    with torch.no_grad():
        perturb_(model, seed)
    return HfImageModel(model).train()


@pytest.mark.parametrize("kind, implementation", [("sam", "eager"), ("sam", "sdpa"), ("sam_hq", "sdpa"),
                                                  ("vitdet", "eager")])
def test_transformers_training_step(kind, implementation):
    model = hf_model(kind, implementation)
    ours = patch_model(copy.deepcopy(model), strict=True)
    report = patch_report(ours)
    assert len(report.patched) == 2 and [m.layout for m in report.modules] == ["window 3x3", "global 8x8"]
    passes_training_step(model, ours, (32, 32))


def test_transformers_attention_weights_asked_for_run_transformers():
    """SAM's eager class computes its attention weights: asked for, they are transformers' own."""
    model = hf_model("sam").eval()
    ours = patch_model(copy.deepcopy(model), strict=True)
    x = images(1, (32, 32))
    with torch.no_grad():
        theirs = model.model(pixel_values=x, output_attentions=True)
        mine = ours.model(pixel_values=x, output_attentions=True)
    assert len(mine.attentions) == 2 and all(torch.allclose(a, b, atol=1e-5)
                                             for a, b in zip(mine.attentions, theirs.attentions))


def test_transformers_default_configs_through_the_cli_route():
    """``--hf sam`` at another size than SAM's 1024 px (its vision and prompt encoders take
    the size), and transformers' default ViTDet, which has no relative positions: its
    modules are reported kept on their own forward, not a crash in the report."""
    from timm_flashwin.tools.hf_models import build_hf_model
    sam = build_hf_model("sam", img_size=32)
    assert sam.pretrained_cfg["input_size"] == (3, 32, 32) and sam(images(1, (32, 32))).shape == (1, 3)
    vitdet = patch_model(build_hf_model("vitdet", img_size=32))
    report = patch_report(vitdet)
    assert not report.patched and len(report.skipped) == 12 and "kept their own forward" in report.summary()
    assert all("use_rel_pos=False" in m.reason for m in report.skipped)


# ----------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_samvit_base_full_resolution(dtype):
    full_resolution_passes("samvit_base_patch16", dtype, batch=1)
