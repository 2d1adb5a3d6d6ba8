"""timm's factory patched (timm_flashwin/factory.py) and ``timm-flashwin run``
(timm_flashwin/runner.py): models created by every route are patched, timm is left exactly
as it was, scripts run as python runs them. Tiny models, no forward."""
import json
import logging
import os
import subprocess
import sys
import types
import warnings

import pytest
import timm
import timm.models
import timm.models._factory
import wrapt

from timm_flashwin import PatchError, is_patched, patch_report, patch_timm, patched_timm, unpatch_timm
from timm_flashwin.patching import factory
from timm_flashwin.patching.adapters.base import RECOMPUTE_QKV_ATTR
from timm_flashwin.tools.cli import main
from timm_flashwin.tools.runner import Target, split_argv

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
MAKE_MODELS, FAIL = os.path.join(SCRIPTS, "make_models.py"), os.path.join(SCRIPTS, "fail.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: timm's function, held as an attribute: a module-level name bound to it (this module's too)
#: is the wrapper while patch_timm is active
TIMM = types.SimpleNamespace(create_model=timm.models._factory.create_model)
SWIN = "swin_tiny_patch4_window7_224"
TINY = dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)  # 4 attention modules
TIMM_NAMESPACES = (timm, timm.models, timm.models._factory)


def namespaces():
    """Every name of timm's three namespaces with what it is bound to (compared by identity)."""
    return [dict(vars(m)) for m in TIMM_NAMESPACES]


def same_objects(before, after):
    return all(b.keys() == a.keys() and all(b[k] is a[k] for k in b) for b, a in zip(before, after))


@pytest.fixture(autouse=True)
def timm_restored():
    """Every test leaves timm's factory unpatched, whatever it did."""
    yield
    unpatch_timm()
    assert timm.create_model is TIMM.create_model and timm.models.create_model is TIMM.create_model


# ------------------------------------------------------------------ run, as a subprocess
def child(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def children():
    """Both ``timm-flashwin run`` subprocesses, started together (most of their time is imports)."""
    procs = {
        # python -m timm_flashwin; run's options, then the script's, some spelled as run's
        "make_models": child("-m", "timm_flashwin", "run", "--report", "--recompute-qkv", "--no-feature-map",
                             MAKE_MODELS, "--exit-code", "3", "--strict", "-m", "x"),
        # the console script's entry point; a relative path, as typed
        "fail": child("-c", "from timm_flashwin.tools.cli import console_main; console_main()", "run",
                      os.path.relpath(FAIL, REPO), "/no/such/file"),
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_run_script_by_every_route(children):
    """Every route to the factory returns a patched model, with run's options; the script's
    arguments (also ones spelled like run's) and exit code pass through; --report prints
    every model's report; the ViT is left alone, without a warning."""
    out, err = children["make_models"].communicate(timeout=300)
    assert children["make_models"].returncode == 3, err[-3000:]
    seen = json.loads(out)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [MAKE_MODELS, "--exit-code", "3", "--strict", "-m", "x"]
    models = seen["models"]
    assert len(models) == 7
    vit = models.pop("test_vit")
    assert vit == dict(model="VisionTransformer", flashwin_classes=[], recompute_qkv=False)
    for route, model in models.items():  # --no-feature-map: timm's blocks; --recompute-qkv
        assert model == dict(model="SwinTransformer", flashwin_classes=["FlashSwinWindowAttention"],
                             recompute_qkv=True), route
    assert "timm_flashwin: timm's factory returned 7 model(s)" in err
    assert err.count(f"{SWIN}: patched 4 of 4 attention modules of SwinTransformer (swin: 4)") == 6
    assert "test_vit: VisionTransformer has no timm window attention; returned as timm built it" in err
    assert "arn" not in err and "Traceback" not in err  # no warning (Warning, warn) of any kind


def test_failing_script_prints_and_exits_as_with_python(children):
    out, err = children["fail"].communicate(timeout=300)
    python = subprocess.run([sys.executable, os.path.relpath(FAIL, REPO), "/no/such/file"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert python.returncode == 1 and "RuntimeError: cannot read /no/such/file" in python.stderr
    assert (children["fail"].returncode, out, err) == (1, python.stdout, python.stderr)


# ------------------------------------------------------------------- run, in this process
def test_run_module_in_process(capsys, monkeypatch):
    """-m MODULE: run as python -m runs it (sys.path[0] the current directory, argv[0] its
    file), with patch_model's defaults; the process's argv, path and __main__ as they were."""
    monkeypatch.chdir(SCRIPTS)
    argv, path, main_module = sys.argv[:], sys.path[:], sys.modules["__main__"]
    assert main(["run", "-m", "make_models", "a b", "--report"]) == 0
    assert (sys.argv, sys.path, sys.modules["__main__"]) == (argv, path, main_module)
    seen = json.loads(capsys.readouterr().out)
    assert seen["name"] == "__main__" and seen["argv"] == [MAKE_MODELS, "a b", "--report"]
    assert seen["models"]["from timm import create_model"] == dict(
        model="SwinTransformer", flashwin_classes=["FlashSwinTransformerBlock", "FlashSwinWindowAttention"],
        recompute_qkv=False)


def test_run_strict_raises_in_the_script(capsys, monkeypatch):
    """--strict: a Swin model the op cannot fully serve raises PatchError where the script
    created it; the traceback starts in the script, exit code 1."""
    monkeypatch.chdir(SCRIPTS)
    assert main(["run", "--strict", "-m", "make_models", "--unservable"]) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].startswith(f'  File "{MAKE_MODELS}", line ')
    assert not any(name in err for name in ("runner.py", "runpy", "cli.py"))
    assert "timm_flashwin.patching.report.PatchError: timm_flashwin: cannot patch 4 window-attention module(s) of SwinTransformer:" in err
    assert lines[-1] == "  layers.1.blocks.1.attn: attn_drop=1.0 is not in [0, 1)"


def test_run_usage_errors(capsys):
    assert main(["run", "/no/such/script.py"]) == 2
    assert "can't open file '/no/such/script.py': [Errno 2] No such file or directory" in capsys.readouterr().err
    assert main(["run", "-m", "no_such_module_of_timm_flashwin"]) == 1
    assert capsys.readouterr().err == "timm-flashwin run: No module named no_such_module_of_timm_flashwin\n"
    for argv in (["run"], ["run", "--report"], ["run", "-m"], ["run", "--unknown", "x.py"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_split_argv():
    assert split_argv(["--report", "train.py", "--strict", "-m", "x"]) == (
        ["--report"], Target("train.py", False, ["--strict", "-m", "x"]))
    assert split_argv(["--strict", "-m", "pkg.mod", "-m", "y"]) == (["--strict"], Target("pkg.mod", True, ["-m", "y"]))
    assert split_argv(["-mpkg.mod", "a"]) == ([], Target("pkg.mod", True, ["a"]))
    assert split_argv(["--strict"]) == (["--strict"], None) and split_argv(["-m"]) == ([], None)


# ----------------------------------------------------------------------- the factory API
def test_patch_and_unpatch_leave_timm_exactly_as_it_was():
    before = namespaces()
    patch_timm()
    wrapper = timm.create_model
    assert isinstance(wrapper, wrapt.FunctionWrapper) and wrapper.__wrapped__ is TIMM.create_model
    assert timm.models.create_model is wrapper and timm.models._factory.create_model is wrapper
    assert is_patched(timm.create_model(SWIN, **TINY))
    unpatch_timm()
    assert same_objects(before, namespaces()) and timm.create_model is TIMM.create_model
    unpatch_timm()  # nothing to undo
    assert same_objects(before, namespaces())
    assert not is_patched(timm.create_model(SWIN, **TINY))


def test_names_bound_before_and_during_activation(monkeypatch):
    """Module-level names bound to timm's function before activation are rebound to the
    wrapper and back; names bound while active get timm's function back too. A reference
    that is not a module-level name keeps timm's function (the documented limit)."""
    early = types.ModuleType("flashwin_user_module_early")
    exec("from timm import create_model\nfrom timm.models import create_model as make", early.__dict__)
    monkeypatch.setitem(sys.modules, early.__name__, early)
    local = timm.create_model
    patch_timm()
    assert early.create_model is timm.create_model and early.make is timm.create_model
    assert is_patched(early.create_model(SWIN, **TINY)) and is_patched(early.make(SWIN, **TINY))
    assert not is_patched(local(SWIN, **TINY))  # a local bound before activation: not reached
    late = types.ModuleType("flashwin_user_module_late")
    exec("from timm.models import create_model", late.__dict__)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    wrapper = late.create_model
    assert wrapper is timm.create_model
    unpatch_timm()
    assert early.create_model is TIMM.create_model and early.make is TIMM.create_model and late.create_model is TIMM.create_model
    assert not is_patched(wrapper(SWIN, **TINY))  # a wrapper kept past unpatch_timm patches nothing


def test_repeated_and_nested_activation():
    def block_and_recompute(model):
        block = model.layers[0].blocks[0]
        return type(block).__name__, bool(block.attn.__dict__.get(RECOMPUTE_QKV_ATTR))

    patch_timm()
    patch_timm(feature_map=False)  # replaces the arguments; one wrapper, not a wrapper of it
    assert timm.create_model.__wrapped__ is TIMM.create_model
    assert block_and_recompute(timm.create_model(SWIN, **TINY)) == ("SwinTransformerBlock", False)
    with patched_timm(recompute_qkv=True) as outer:
        assert block_and_recompute(timm.create_model(SWIN, **TINY)) == ("FlashSwinTransformerBlock", True)
        with patched_timm(filter_fn=lambda module, name: name.startswith("layers.0.")) as inner:
            assert len(patch_report(timm.create_model(SWIN, **TINY)).patched) == 2
        assert block_and_recompute(timm.create_model(SWIN, **TINY)) == ("FlashSwinTransformerBlock", True)
        assert timm.create_model.__wrapped__ is TIMM.create_model
    assert [len(c.report.patched) for c in outer] == [4, 2, 4] and len(inner) == 1
    assert block_and_recompute(timm.create_model(SWIN, **TINY)) == ("SwinTransformerBlock", False)
    unpatch_timm()
    with pytest.raises(RuntimeError, match="the script's"):
        with patched_timm():
            assert is_patched(timm.create_model(SWIN, **TINY))
            raise RuntimeError("the script's")
    assert timm.create_model is TIMM.create_model


def test_patched_timm_scopes_the_factory_not_the_models():
    """What the docstring and the README say: a model created inside stays patched after
    the block; the factory alone is restored."""
    with patched_timm() as created:
        inside = timm.create_model(SWIN, **TINY)
    assert is_patched(inside) and len(created) == 1
    assert not is_patched(timm.create_model(SWIN, **TINY))
    assert "stays patched after" in patched_timm.__doc__


def test_report_logged_once_and_other_models_left_alone(caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="timm_flashwin"):
        warnings.simplefilter("always")
        with patched_timm() as created:
            swin = timm.create_model(SWIN, **TINY)
            vits = [timm.create_model("test_vit") for _ in range(3)]
    assert caught == [] and is_patched(swin) and not any(is_patched(v) for v in vits)
    assert all(not type(m).__module__.startswith("timm_flashwin") for v in vits for m in v.modules())
    assert [r.getMessage() for r in caplog.records] == [
        "timm_flashwin: patched 4 of 4 attention modules of SwinTransformer (swin: 4)"]
    assert [c.name for c in created] == [SWIN] + ["test_vit"] * 3
    assert str(created[1]) == "test_vit: VisionTransformer has no timm window attention; returned as timm built it"
    assert str(created[0]).startswith(f"{SWIN}: patched 4 of 4") and "layers.1.blocks.1.attn [swin] patched" in \
        str(created[0])


def test_a_factory_calling_itself_patches_and_logs_once(caplog):
    """A model entrypoint that calls timm's factory for its backbone (a lab's registered
    model): the outer call patches the whole model, the inner one returns it as built."""
    from torch import nn

    def lab_model(name, **kwargs):
        return nn.Sequential(timm.create_model(SWIN, **TINY))

    lab_factory = wrapt.FunctionWrapper(lab_model, factory._create_model)  # as timm's function is wrapped
    with caplog.at_level(logging.INFO, logger="timm_flashwin"), patched_timm() as created:
        model = lab_factory("lab_swin")
    assert is_patched(model) and [c.name for c in created] == ["lab_swin"]
    assert len(caplog.records) == 1 and "of Sequential" in caplog.records[0].getMessage()


def test_patch_model_options_pass_through_and_are_checked():
    before = namespaces()
    with pytest.raises(TypeError, match="patch_model takes strict, filter_fn, recompute_qkv, feature_map"):
        patch_timm(feature_maps=False)
    assert same_objects(before, namespaces())
    with patched_timm(strict=True):
        with pytest.raises(PatchError, match="attn_drop=1.0"):
            timm.create_model(SWIN, attn_drop_rate=1.0, **TINY)
        timm.create_model("test_vit")  # strict concerns Swin models only
    with patched_timm():
        report = patch_report(timm.create_model(SWIN, attn_drop_rate=1.0, **TINY))
    assert not report.patched and {m.reason for m in report.skipped} == {"attn_drop=1.0 is not in [0, 1)"}


def test_installed_when_timm_is_imported_later(monkeypatch, tmp_path):
    """patch_timm before timm is imported: a wrapt post-import hook installs the wrapper
    when it is. (Importing timm_flashwin imports timm, so a stand-in for timm's factory
    module, not yet imported, takes its place here.)"""
    name = "flashwin_standin_factory"
    (tmp_path / f"{name}.py").write_text("import timm\n\n\ndef create_model(*args, **kwargs):\n"
                                         "    return timm.models._factory.create_model(*args, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for attr, value in (("_TIMM", name), ("_FACTORY_MODULE", name), ("_pair", None), ("_hook_registered", False)):
        monkeypatch.setattr(factory, attr, value)
    try:
        patch_timm()
        assert name not in sys.modules and factory._hook_registered
        import flashwin_standin_factory as standin
        assert isinstance(standin.create_model, wrapt.FunctionWrapper)
        assert is_patched(standin.create_model(SWIN, **TINY))
        unpatch_timm()
        assert not isinstance(standin.create_model, wrapt.FunctionWrapper)
    finally:
        unpatch_timm()
        sys.modules.pop(name, None)


def test_the_librarys_own_tools_build_timms_unpatched_models():
    """verify compares a patched model with timm's: under patched_timm it must still get
    timm's unpatched model (and list describes timm's models)."""
    from timm_flashwin.tools.verify import build_model
    with patched_timm():
        assert any(is_patched(m) for m in timm.create_model("swin_tiny_patch4_window7_224").modules())
        model = build_model("swin_tiny_patch4_window7_224")
        assert not any(is_patched(m) for m in model.modules())
