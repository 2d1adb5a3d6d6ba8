"""The command line's torchvision routes: ``list --tv``, ``verify --tv NAME``, ``bench --tv
NAME`` (timm_flashwin/tools/tv_models.py). The models' own checks: test_torchvision_swin.py."""
import json

import pytest

from timm_flashwin.tools.cli import main
from timm_flashwin.tools.tv_models import build_tv_model, input_size


def test_list_tv_shows_torchvisions_swin_models(capsys):
    assert main(["list", "--tv", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {f"swin{kind}_{size}" for kind in ("", "_v2", "3d") for size in "tsb"}
    assert rows["swin3d_t"] == dict(name="swin3d_t", families=["tv_swin3d"], stage_windows=[[8, 7, 7]], modules=12)
    assert rows["swin_v2_b"]["families"] == ["tv_swinv2"] and rows["swin_v2_b"]["modules"] == 24
    assert rows["swin_s"]["stage_windows"] == [[7, 7]]


def test_tv_models_inputs():
    """Images at the weights' crop size, clips of 16 frames; img_size sets the frames' size;
    stochastic depth off for training comparisons."""
    assert input_size("swin_t") == (3, 224, 224) and input_size("swin_v2_t") == (3, 256, 256)
    assert input_size("swin3d_t") == (3, 16, 224, 224) and input_size("swin3d_t", 112) == (3, 16, 112, 112)
    model = build_tv_model("swin_t", train=True, overrides=dict(num_classes=3))
    assert model.pretrained_cfg["input_size"] == (3, 224, 224) and model.model.head.out_features == 3
    assert all(m.p == 0.0 for m in model.modules() if type(m).__name__ == "StochasticDepth")


@pytest.mark.parametrize("args,message", [
    (["verify", "--tv", "swin_q"], "--tv swin_q: not a torchvision model; did you mean swin_t"),
    (["verify", "swin_tiny_patch4_window7_224", "--tv", "swin_t"], "give a timm model name, --hf CONFIG or --tv NAME"),
    (["verify", "--tv", "resnet18"], "tv:resnet18 (TvModel) has no timm window attention to patch"),
])
def test_tv_usage_errors_exit_2(capsys, args, message):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
