"""transformers' constructors patched (timm_flashwin/factory_hf.py), and ``timm-flashwin run``
on a transformers script that timm_flashwin does not edit."""
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from hf_cases import config  # noqa: E402
from timm_flashwin import patch_report  # noqa: E402
from timm_flashwin.factory_hf import patch_transformers, patched_transformers, unpatch_transformers  # noqa: E402

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
