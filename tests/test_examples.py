"""examples/*.py: each has --help with a description and its defaults, runs as its docstring
says (small sizes: under the interpreter on a CPU every program runs in Python) printing its
progress, and its own check holds. Run in this process (imported from their files; no
subprocess): train_ddp.py under torchrun is tests/test_distributed.py's."""
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from conftest import HAS_CUDA

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("inference", "train_amp", "train_ddp", "train_local")


def example(name: str) -> ModuleType:
    """examples/NAME.py as a module (its ``if __name__ == "__main__"`` part not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_help_with_defaults(capsys):
    for name in EXAMPLES:
        module = example(name)
        with pytest.raises(SystemExit) as info:
            module.parse_args(["--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert info.value.code == 0 and "(default: " in out, name
        assert " ".join(module.__doc__.split()[:6]) in out, name  # the docstring's opening, as the description


def test_train_ddp_outside_torchrun_says_how_to_launch(capsys, monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit) as info:
        example("train_ddp").main(["--device", "cpu"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: not launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set)" in err
    assert "torchrun --standalone --nproc_per_node=2" in err


def test_inference_compares_a_model_whose_attention_matters(capsys, monkeypatch):
    """The perturbed weights make attention reach the output: the check passes, and an
    attention that outputs zeros fails it (timm's zero-initialised SwinV2 would pass it)."""
    inference = example("inference")
    argv = ["--batch", "1", "--img-size", "32"]
    inference.main(argv)
    out = capsys.readouterr().out
    assert "building swinv2_tiny_window8_256 (random init, perturbed)" in out
    assert f"running the patched model (attention: {'triton' if HAS_CUDA else 'triton-interpreter'})" in out
    assert "top-1 agreement with unpatched timm 100%" in out

    import timm_flashwin.patching.adapters.base as base
    real = base.window_attention
    monkeypatch.setattr(base, "window_attention", lambda *a, **k: real(*a, **k) * 0)
    with pytest.raises(SystemExit, match="the patched model's output differs from timm's by"):
        inference.main(argv)


def test_train_amp_prints_each_step_and_the_losses_match(capsys):
    """One step (on a CPU, the kernels under the interpreter): the patched copy's loss is timm's."""
    example("train_amp").main(["--steps", "1", "--batch", "1", "--img-size", "56"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("building swin_tiny_patch4_window7_224 at 56x56 on ")
    road = "the Triton kernels" if HAS_CUDA else "the Triton kernels under Triton's interpreter"
    assert lines[1].endswith(f"(swin: 12); attention computed by {road}" + ("" if HAS_CUDA else " (TRITON_INTERPRET=1: slow)"))
    assert lines[2].split()[:3] == ["step", "1/1", "timm"] and lines[2].split()[4] == "flashwin"
    assert lines[3].startswith("losses match within ")


def test_train_local_losses_match_the_reference(capsys):
    """The frame model trained with the local-attention operators (the Triton kernels, under
    the interpreter) has the losses of the same model on the PyTorch reference, step by
    step, each printed as it is done, and training lowers the loss of the first step's
    videos: at 2 steps too (its check compared the second step's loss, of other videos, with
    the first's and exited 1), and it says what computed the attention."""
    example("train_local").main(["--steps", "2", "--frames", "3", "--frame-tokens", "8", "--local", "8", "--dim",
                                 "16", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--batch", "1",
                                 "--sinks", "2", "--window", "2"])
    out = capsys.readouterr().out
    assert "losses match" in out and "the first step's videos: loss" in out, out
    road = "the Triton kernels" if HAS_CUDA else "the Triton kernels under Triton's interpreter"
    assert out.splitlines()[0].startswith("2 steps of 1 videos") and f"attention: {road}" in out.splitlines()[0]
    # two steps printed: step, reference loss, flashwin loss, relative difference
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all(float(row[3]) <= 1e-4 for row in rows), out
    with pytest.raises(SystemExit):
        example("train_local").parse_args(["--steps", "0"])
