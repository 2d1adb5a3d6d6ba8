"""transformers models from the command line: ``verify --hf CONFIG`` (timm_flashwin/hf_models.py),
transformers' constructors patched (timm_flashwin/factory_hf.py) and ``timm-flashwin run`` on a
transformers script that timm_flashwin does not edit."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from hf_cases import config  # noqa: E402
from timm_flashwin import patch_report  # noqa: E402
from timm_flashwin.tools.cli import EXIT_OK, EXIT_USAGE, main  # noqa: E402
from timm_flashwin.patching.factory_hf import patch_transformers, patched_transformers, unpatch_transformers  # noqa: E402
from timm_flashwin.tools.hf_models import load_config, model_class  # noqa: E402
from timm_flashwin.tools.verify import UsageError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_from_config_and_from_pretrained_are_patched(tmp_path):
    """Inside ``patched_transformers``: ``from_config`` (Auto class), ``from_pretrained`` (the
    model's class and an Auto class) return patched models, each recorded once; outside,
    and after ``unpatch_transformers``, transformers' own classmethods, unwrapped."""
    base = transformers.PreTrainedModel
    own = {name: base.__dict__[name] for name in ("from_pretrained", "_from_config")}
    transformers.SwinForImageClassification(config("hf_swin")).save_pretrained(tmp_path)
    with patched_transformers(recompute_qkv=True) as created:
        models = [transformers.AutoModelForImageClassification.from_config(config("hf_swinv2")),
                  transformers.SwinForImageClassification.from_pretrained(tmp_path),
                  transformers.AutoModel.from_pretrained(tmp_path)]
    assert [len(patch_report(m).patched) for m in models] == [2, 2, 2]
    assert [c.report.model for c in created] == ["Swinv2ForImageClassification", "SwinForImageClassification",
                                                 "SwinModel"]
    assert all(m._flashwin_recompute_qkv for model in models for m in model.modules() if hasattr(m, "_flashwin_family"))
    assert {name: base.__dict__[name] for name in own} == own
    assert not patch_report(transformers.AutoModel.from_config(config("hf_swin"))).patched
    patch_transformers()
    unpatch_transformers()
    assert {name: base.__dict__[name] for name in own} == own
    with pytest.raises(TypeError, match="patch_transformers: .*patch_model takes"):
        patch_transformers(strictly=True)


def test_run_patches_an_unedited_transformers_script(tmp_path):
    """``timm-flashwin run --report SCRIPT``: the script imports transformers itself (the
    post-import hook installs the wrappers) and gets patched models."""
    script = tmp_path / "script.py"
    script.write_text(
        "import transformers\n"
        "cfg = transformers.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[2], num_heads=[2], "
        "window_size=4)\n"
        "model = transformers.AutoModelForImageClassification.from_config(cfg)\n"
        "print(sorted({type(m).__name__ for m in model.modules() if 'Attention' in type(m).__name__}))\n")
    result = subprocess.run([sys.executable, "-m", "timm_flashwin", "run", "--report", str(script)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("['FlashSwinAttention']")
    assert "transformers' from_pretrained / from_config returned 1 model(s)" in result.stderr


def test_verify_hf_config(tmp_path, capsys):
    """``verify --hf DIR --train``: a saved config's model (random weights), patched, passes
    verify's rule against transformers' own through the kernels; a model name and --hf
    together, or neither, is a usage error."""
    config("hf_swinv2").save_pretrained(tmp_path)
    assert main(["verify", "--hf", str(tmp_path), "--train", "--batch", "1", "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["patched_modules"] == 2 and len(result["layers"]) == 2
    assert result["backend"] in ("triton", "triton-interpreter")
    # the human-readable report calls the unpatched model transformers', never timm's
    assert main(["verify", "--hf", str(tmp_path), "--batch", "1"]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "patched vs transformers" in out and "transformers err" in out and "2 x transformers' own error" in out
    assert "timm" not in out.replace(str(tmp_path), "") and "match the unpatched transformers model" in out
    for argv in (["verify"], ["verify", "swin_tiny_patch4_window7_224", "--hf", "swin"]):
        assert main(argv) == EXIT_USAGE
        assert "give a timm model name, --hf CONFIG or --tv NAME, one of them" in capsys.readouterr().err


def test_hf_config_names():
    """--hf's CONFIG: a model type, a config class, ':ModelClass' for the head; anything else
    a clear usage error."""
    swin2sr, head = load_config("swin2sr:Swin2SRForImageSuperResolution")
    assert type(swin2sr).__name__ == "Swin2SRConfig" and model_class(swin2sr, head).__name__ == head
    donut, head = load_config("DonutSwinConfig")
    assert head is None and model_class(donut, head).__name__ == "DonutSwinForImageClassification"
    maskformer, head = load_config("maskformer-swin")
    assert model_class(maskformer, head).__name__ == "MaskFormerSwinModel"
    with pytest.raises(UsageError, match="--hf no-such-model: neither a transformers model type"):
        load_config("no-such-model")
    with pytest.raises(UsageError, match="not a transformers model class"):
        model_class(swin2sr, "NoSuchModel")
