"""The command line: verify, list and bench, their output and exit codes."""
import json
import os
import subprocess
import sys

import pytest
import timm
import torch

from conftest import HAS_CUDA
from timm_flashwin.tools.cli import ERROR_COLUMNS, main


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# One image per verify (the default is 2): the kernels' work halves, and nothing in verify
# depends on the batch but the images' count (CI time).
@pytest.mark.parametrize("name,size,extra", [  # swin_tiny, --train: test_verify_json; SwinV2: test_patching's
    ("swinv2_cr_tiny_224", "128", ["--batch", "1"]),  # 4x4 windows; timm 1.0.29 cannot run it at 112
    ("maxvit_nano_rw_256", "128", ["--batch", "1"]),  # 4x4 block and grid windows (maxxvit)
    ("coatnet_nano_rw_224", "128", ["--batch", "1"]),  # the 8x8 and 4x4 maps (maxxvit_2d); timm fails at 112
])
@pytest.mark.long
def test_verify_passes(capsys, name, size, extra):
    code, out, err = run_cli(capsys, "verify", name, "--img-size", size, *extra)
    assert code == 0, out + err
    assert f"PASS {name}" in out and "perturbed so that attention matters" in out
    assert "<output>" in out and "top-1 agreement" in out and ERROR_COLUMNS in " ".join(out.split())
    if "--train" in extra:
        assert "gradients:" in out


@pytest.mark.long
def test_verify_json(capsys):
    """Also the passing verify of Swin V1 (the human-readable report: test_verify_passes)."""
    code, out, _ = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--img-size", "56", "--train", "--json",
                           "--batch", "1")
    result = json.loads(out)
    assert code == 0 and result["passed"] is True
    assert result["settings"]["train"] is True and result["settings"]["dtype"] == "float32"
    assert len(result["layers"]) == 12 and result["output"]["passed"]
    assert len(result["grads"]) > 100 and all(g["passed"] for g in result["grads"])
    assert result["backend"] in ("triton", "triton-interpreter")


def test_verify_mismatch_exits_1(capsys, monkeypatch):
    """A wrong kernel must be caught: scale the op's output slightly."""
    import timm_flashwin.patching.adapters.base as base
    real = base.window_attention
    monkeypatch.setattr(base, "window_attention", lambda *a, **k: real(*a, **k) * 1.01)
    code, out, _ = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--img-size", "56", "--json", "--batch", "1")
    assert code == 1 and json.loads(out)["passed"] is False


def test_timm_second_run_moves_every_pixel_one_ulp():
    """verify runs timm a second time on jittered images; its error is a second draw of
    timm's rounding noise, and the larger of the two is the one the tolerance uses."""
    from timm_flashwin.tools.comparison import compare, jitter_images, larger_error
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    moved = jitter_images(x)
    assert torch.equal(jitter_images(x), moved)  # the same images for timm on every run
    up, down = torch.nextafter(x, torch.full_like(x, 1e9)), torch.nextafter(x, torch.full_like(x, -1e9))
    assert torch.all((moved == up) | (moved == down)) and (moved == up).any() and (moved == down).any()
    assert larger_error(1e-5, 3e-5) == 3e-5 and larger_error(3e-5, 1e-5) == 3e-5
    assert larger_error(1e-5, float("nan")) == 1e-5 and larger_error(1e-5, None) == 1e-5
    ref = torch.ones(100, dtype=torch.float64)
    ours, timm_out = ref.float() * (1 + 5e-4), ref.float() * (1 + 1e-4)
    assert not compare("t", ours, timm_out, ref, 1e-4, 0.0).passed  # 5e-4 > 2 x 1e-4
    assert compare("t", ours, timm_out, ref, 1e-4, 0.0, timm_again=ref.float() * (1 - 3e-4)).passed
    assert compare("t", ours, timm_out, ref, 1e-4, 0.0, timm_again=ref.float() * (1 - 3e-4)).err_timm == \
        pytest.approx(3e-4, rel=1e-3)


def test_verify_builds_the_same_model_for_the_same_seed():
    """A failing verify can be rerun: the random init comes from --seed, and the caller's
    RNG is left as it was."""
    from timm_flashwin.tools.verify import build_model
    state = torch.random.get_rng_state()
    first, again, other = (build_model("swin_tiny_patch4_window7_224", img_size=56, seed=s).state_dict()
                           for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["layers.0.blocks.0.attn.qkv.weight"], other["layers.0.blocks.0.attn.qkv.weight"])


def test_verify_with_checkpoint(capsys, tmp_path):
    model = timm.create_model("swin_tiny_patch4_window7_224", img_size=56)
    path = tmp_path / "weights.pth"
    torch.save(model.state_dict(), path)
    code, out, err = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--img-size", "56", "--checkpoint",
                             str(path), "--batch", "1")
    assert code == 0, out + err
    assert "perturbed" not in out
    # the rule each row is judged by, with this run's numbers (not a bare rtol beside rows far above it)
    assert ("a tensor passes when its error vs float64 <= max(1e-04, 2 x timm's own error) + 1e-06 / rms(float64)"
            in " ".join(out.split()))
    assert "forward of the patched model match the unpatched timm model" in out


USAGE_ERRORS = [
    (["verify", "swin_tiny_patch"], "unknown timm model 'swin_tiny_patch'; did you mean swin_tiny_patch4_window7_224"),
    (["verify", "resnet18"], "resnet18 (ResNet) has no timm window attention"),
    (["verify", "swin_tiny_patch4_window7_224", "--checkpoint", "/no/such/file.pth"], "no such file"),
    (["verify", "swin_tiny_patch4_window7_224", "--dtype", "float64"], "invalid choice"),
    # bad values: argparse's types, before anything is built
    (["verify", "swin_tiny_patch4_window7_224", "--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
    (["verify", "swin_tiny_patch4_window7_224", "--batch", "-1"], "argument --batch: expected an integer >= 1"),
    (["verify", "swin_tiny_patch4_window7_224", "--device", "tpu"],
     "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["verify", "swin_tiny_patch4_window7_224", "--img-size", "0x8"], "argument --img-size: expected N or H,W"),
    (["verify", "swin_tiny_patch4_window7_224", "--rtol", "-0.001"], "argument --rtol: expected a finite number >= 0"),
    (["bench", "swin_tiny_patch4_window7_224", "--repeats", "0"], "argument --repeats: expected an integer >= 1"),
    (["bench", "swin_tiny_patch4_window7_224", "--warmup", "x"], "argument --warmup: expected an integer >= 0"),
    # a value timm's own model cannot run: found by its float64 forward, before the patched one
    (["verify", "swin_tiny_patch4_window7_224", "--img-size", "2"],
     "swin_tiny_patch4_window7_224 (timm's own model, unpatched) cannot run images of 2x2"),
]


@pytest.mark.parametrize("args,message", USAGE_ERRORS, ids=lambda v: v[1] if isinstance(v, list) else None)
def test_usage_errors_exit_2(capsys, args, message):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].count("error:") == 1  # the last line says it


def test_checkpoint_that_does_not_fit(capsys, tmp_path):
    path = tmp_path / "other.pth"
    torch.save(timm.create_model("resnet18").state_dict(), path)
    code, _, err = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--checkpoint", str(path))
    assert code == 2 and "does not fit SwinTransformer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_cuda_asked_but_absent(capsys):
    code, _, err = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--device", "cuda")
    assert code == 2 and "no CUDA device" in err


def test_a_device_or_batch_the_library_cannot_take(monkeypatch):
    """The Python API's checks behind the command line's: a GPU index past the machine's
    (two GPUs pretended here), a batch of 0."""
    from timm_flashwin.tools.verify import UsageError, resolve_device, verify_model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    with pytest.raises(UsageError, match="--batch 0: expected an integer >= 1"):
        verify_model("swin_tiny_patch4_window7_224", batch=0)


@pytest.mark.skipif(HAS_CUDA, reason="bench runs on a GPU")
def test_bench_on_cpu_exits_2(capsys):
    code, _, err = run_cli(capsys, "bench", "swin_tiny_patch4_window7_224")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run_cli(capsys, "bench", "swin_tiny_patch4_window7_224", "--compile-mode", "reduce-overhead")
    assert code == 2 and "needs a CUDA GPU" in err  # the option parses (argparse errors exit 2 too)
    code, _, err = run_cli(capsys, "bench", "swin_tiny_patch4_window7_224", "--train", "--recompute-qkv")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run_cli(capsys, "bench", "swin_tiny_patch4_window7_224", "--train", "--recompute-qkv", "layers.1.")
    assert code == 2 and "needs a CUDA GPU" in err


def test_bench_recompute_qkv_variants():
    """bench's third variant: recompute_qkv for every module, or for names starting with a
    prefix (one name or several; a single string is one prefix, not its characters)."""
    from timm_flashwin.tools.bench import model_variants, recompute_qkv_option
    # the option as parsed: absent, given alone, given with names
    assert recompute_qkv_option(None) is False and recompute_qkv_option([]) is True
    assert recompute_qkv_option(["layers.1."]) == ["layers.1."]
    assert list(model_variants(False)) == ["timm", "flashwin"]
    assert model_variants(True)["flashwin-recompute-qkv"] is True
    for given, label in (("layers.1.", "layers.1."), (["layers.1.", "layers.2."], "layers.1.,layers.2.")):
        picks = model_variants(given)[f"flashwin-recompute-qkv({label})"]
        assert picks(None, "layers.1.blocks.0.attn") and not picks(None, "layers.0.blocks.0.attn")
        assert not picks(None, "l")
    assert model_variants(["layers.1.", "layers.2."])["flashwin-recompute-qkv(layers.1.,layers.2.)"](
        None, "layers.2.blocks.5.attn")


def test_bench_compile_mode_needs_compile():
    from timm_flashwin.tools.bench import UsageError, benchmark_model
    with pytest.raises(UsageError, match="compile_mode='reduce-overhead' needs compile=True"):
        benchmark_model("swin_tiny_patch4_window7_224", compile_mode="reduce-overhead")


def test_hub_weights_unreachable_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=os.environ.get("HF_HOME", "/nonexistent-hf-home"))
    proc = subprocess.run([sys.executable, "-m", "timm_flashwin", "verify", "swin_tiny_patch4_window7_224",
                           "--pretrained", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pretrained weights could not be fetched" in proc.stderr and "Traceback" not in proc.stderr


def test_list(capsys):
    code, out, _ = run_cli(capsys, "list", "swinv2_cr_t*", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == ["swinv2_cr_tiny_224", "swinv2_cr_tiny_384",
                                                       "swinv2_cr_tiny_ns_224"]
    assert rows[1]["families"] == ["swinv2_cr"] and rows[1]["stage_windows"] == [[12, 12]] * 4
    # the table (every swin* name is patched: test_patching's meta-device test)
    code, out, _ = run_cli(capsys, "list", "swinv2_base_window12to2*")
    assert code == 0 and "1 timm models" in out and "swinv2_base_window12to24_192to384" in out
    assert "24x24 24x24 24x24 12x12" in out  # swinv2_base_window12to24_192to384: the last stage is 12x12


def test_list_maxvit_and_coatnet(capsys):
    code, out, _ = run_cli(capsys, "list", "maxvit_tiny_*", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and set(rows) == {"maxvit_tiny_pm_256", "maxvit_tiny_rw_224", "maxvit_tiny_rw_256",
                                       "maxvit_tiny_tf_224", "maxvit_tiny_tf_384", "maxvit_tiny_tf_512"}
    assert rows["maxvit_tiny_tf_512"] == dict(name="maxvit_tiny_tf_512", families=["maxxvit"],
                                              stage_windows=[[16, 16]] * 4, modules=22)
    code, out, _ = run_cli(capsys, "list", "coatnet_rmlp_2*")  # its Attention2d modules: the maxxvit family
    assert code == 0 and "maxxvit" in out and "maxxvit_2d" not in out and "24x24 12x12" in out and "14x14 7x7" in out
    code, out, err = run_cli(capsys, "list", "test_*", "--json")  # timm's test_coatnet, test_maxvit: not listed
    assert code == 1 and json.loads(out) == [] and "no timm model matching 'test_*'" in err
    from timm_flashwin.tools.discovery import supported_models
    calls = []  # what list's progress bar is told, before each model built
    assert len(supported_models("swinv2_cr_tiny_*", progress=lambda *call: calls.append(call))) == 3
    assert calls == [(0, 3), (1, 3), (2, 3)]


def test_python_dash_m_help_starts_without_torch():
    """python -m timm_flashwin runs the command line, and --help imports neither torch nor
    timm (lazy imports: a fraction of a second, where importing them takes seconds)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "timm_flashwin", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "{verify,list,bench,run}" in proc.stdout and "Swin models" not in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "timm_flashwin.tools.cli" in imported and not imported & {"torch", "timm", "triton", "rich"}


def test_list_of_nothing_says_so_and_exits_1(capsys):
    code, out, err = run_cli(capsys, "list", "resnet*")
    assert code == 1 and out == ""
    assert err.strip() == ("timm-flashwin list: no timm model matching 'resnet*' has window attention that "
                           "timm_flashwin patches (timm-flashwin list shows them all)")


def test_the_family_column_has_the_readmes_families():
    """list's family column names model families, as the README counts them: MaxxViT's
    channels-first modules (the maxxvit_2d adapter) are of the maxxvit family."""
    from pathlib import Path
    from timm_flashwin.patching.adapters import ADAPTERS
    families = {adapter.model_family or adapter.family for adapter in ADAPTERS.values()
                if adapter.module_type().__module__.startswith("timm.")}  # timm's (torchvision's are listed apart)
    words = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen"}
    assert "maxxvit_2d" not in families
    assert f"{words[len(families)]} families" in (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_version_and_a_mistyped_option(capsys):
    """--version names the versions it runs with; an unknown option of a subcommand is that
    subcommand's usage error (not the top level's), with the nearest option it has."""
    from importlib import metadata
    import timm_flashwin
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith(f"timm-flashwin {timm_flashwin.__version__} (torch ")
    assert f"timm {metadata.version('timm')}" in out
    for argv, command, hint in ((["verify", "swin_tiny_patch4_window7_224", "--btach", "8"], "verify", "--batch"),
                                (["bench", "swin_tiny_patch4_window7_224", "--repaets=3"], "bench", "--repeats"),
                                (["run", "--reprot", "x.py"], "run", "--report")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith(f"usage: timm-flashwin {command}"), err
        assert f"did you mean {hint}?" in err and "Traceback" not in err


def test_help_says_what_each_command_does(capsys):
    """verify --help states its rule and defaults (the numbers it prints beside each row),
    --batch its default; bench --help says what it times and that it needs a GPU."""
    from timm_flashwin.tools.tolerances import RTOL
    for command in ("verify", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if command == "verify":
            assert "max(rtol, 2 x the unpatched model's own error) + atol / rms(float64)" in text
            assert "a gradient passes when its error <= max(rtol, 4 x the unpatched model's own error, 2 x the " \
                   "unpatched model's error over all gradients) + atol / rms" in text
            assert f"bfloat16 {RTOL['bfloat16']:.0e}" in text
            assert "images per forward (default: 2)" in text
        else:
            assert "Needs a CUDA GPU" in text and "images/s" in text and "(default: 64)" in text


def test_a_file_that_is_no_checkpoint(capsys, tmp_path):
    """A file torch.load cannot read (its own message: "list index out of range") is a usage
    error that says the file is not a checkpoint."""
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    code, _, err = run_cli(capsys, "verify", "swin_tiny_patch4_window7_224", "--img-size", "56", "--checkpoint",
                           str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--checkpoint {path}: not a checkpoint torch.load (weights only) or safetensors can read" in err

