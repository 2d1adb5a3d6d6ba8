"""timm's own model tests, run against patched models.

tests/test_models.py of the installed timm's source distribution (fetched from the package
index into .timm_tests/, git-ignored, on first use), run in a pytest of its own with every
model ``timm.create_model`` returns patched (tests/timm_suite/flashwin_plugin.py): its
scripting, tracing, fx, feature and input-size tests for the three tiny models. Every
selected test must pass, or skip for one of timm's own size limits, and every passing test
must have made a patched model. Without the network the test fails in CI (CI=true) and
skips elsewhere.

Where the tests' tensors sit on the CPU, the patched modules run the op's PyTorch path
(TRITON_INTERPRET=0 in that run): what is checked is the patched model's behaviour under
timm's API and each tool, not the kernels' numbers. Under the interpreter each of those
timm tests that runs the eager model takes one to six minutes (timm's tiny models at up to
448 pixels), past what CI can spend; tests/test_tools.py runs each tool with the kernels,
on smaller models. On a GPU, FLASHWIN_TIMM_SUITE_DEVICE=cuda has the models made there, and
the kernels run. The whole swin* selection, unpatched and patched, then compared (fetch the
source distribution of the GPU machine's timm here first, ``python tests/test_timm_suite.py
--fetch VERSION``, and carry .timm_tests/ along; "abswin" names Hiera models, left out of the
swin* selection measured; four workers fill an 80 GB GPU with the largest models, and
counts on one are in benchmarks/RESULTS.md)::

    cd .timm_tests/timm-VERSION
    export HF_HUB_OFFLINE=1 TORCH_DEVICE=cuda FLASHWIN_TIMM_SUITE_DEVICE=cuda PYTHONPATH=../../tests/timm_suite:../..
    K="swin and not abswin and not pretrained and not test_model_inference"
    RUN="python -m pytest tests/test_models.py -p flashwin_plugin -c pyproject.toml -p no:cacheprovider -q -n 4"
    FLASHWIN_TIMM_SUITE_UNPATCHED=1 $RUN -k "$K" --junitxml=unpatched.xml
    $RUN -k "$K" --junitxml=patched.xml
    python ../../tests/test_timm_suite.py --compare unpatched.xml patched.xml
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: where the source distributions' tests are kept (git-ignored); FLASHWIN_TIMM_TESTS overrides
CACHE = Path(os.environ.get("FLASHWIN_TIMM_TESTS", REPO / ".timm_tests"))
PLUGIN_DIR = Path(__file__).resolve().parent / "timm_suite"

SUITE_MODELS = ("swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224")
#: timm's tests run (-k matches them as substrings of test ids)
SUITE_TESTS = (
    "test_model_forward_torchscript",  # torch.jit.script
    "test_swin_family_script_after_resize",  # torch.jit.script, save, load, after set_input_size
    "test_swin_family_dynamic_mask_trace",  # torch.jit.trace
    "test_model_forward_fx",  # torch.fx, timm's fx tracer
    "test_model_backward_fx",
    "test_model_forward_features",  # features_only
    "test_swin_family_resize_metadata",  # FeatureGetterNet across set_input_size
    "test_swin_family_set_input_size",  # input sizes (and its _invalid_and_min_windows, _after_pruning)
    "test_swin_family_window_padding",  # static and dynamic (padded) masks
)
#: of the tests those names match, the ones left out (CI time: 60 s of 190; the GPU run has them)
SUITE_EXCLUDED = ("fx_torchscript", "stage_windows", "window_ratios")
#: of those, what every timm version since 1.0.15 has: must be found
REQUIRED_TESTS = ("test_model_forward_torchscript", "test_model_forward_fx", "test_model_backward_fx",
                  "test_model_forward_features")
#: skips of timm's own, for its size limits, which patching does not change
ALLOWED_SKIPS = ("Fixed input size model > limit.",)
#: a run's wall-clock limit
TIMEOUT_S = 1200


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _unavailable(message: str) -> None:
    """No timm tests to run: a failure in CI, which must not pass by skipping, else a skip."""
    if _in_ci():
        pytest.fail(f"{message} (CI=true: timm's test suite must run)", pytrace=False)
    pytest.skip(message)


def fetch_timm_tests(version: str, cache: Path = CACHE) -> Path:
    """The folder ``cache/timm-VERSION`` holding that timm source distribution's tests/ and
    pyproject.toml (its pytest configuration), downloaded by pip from the package index if
    not there yet. Raises RuntimeError where pip cannot fetch it."""
    target = cache / f"timm-{version}"
    if (target / "tests" / "test_models.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                   "--disable-pip-version-check", "-d", tmp, f"timm=={version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"`{' '.join(command)}` timed out") from error
        archives = list(Path(tmp).glob("timm-*.tar.gz"))
        if done.returncode or not archives:
            raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-2000:]}")
        unpacked = Path(tmp) / "unpacked"
        prefix = f"timm-{version}/"
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and (
                m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml")]
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(unpacked, members=members, **kwargs)
        if not (unpacked / prefix / "tests" / "test_models.py").is_file():
            raise RuntimeError(f"{archives[0].name} has no tests/test_models.py")
        try:
            (unpacked / prefix).rename(target)
        except OSError:  # made meanwhile by another process
            if not (target / "tests" / "test_models.py").is_file():
                raise
    return target


@pytest.fixture(scope="session")
def timm_tests() -> Path:
    import timm
    try:
        return fetch_timm_tests(timm.__version__)
    except RuntimeError as error:
        _unavailable(f"timm {timm.__version__}'s source distribution could not be fetched: {error}")


def selection(models=SUITE_MODELS, tests=SUITE_TESTS, excluded=SUITE_EXCLUDED) -> str:
    """The -k expression: the tests, of the models, never the pretrained-weight ones (hub)."""
    expression = f"({' or '.join(tests)}) and ({' or '.join(models)}) and not pretrained and not test_model_inference"
    return expression + "".join(f" and not {name}" for name in excluded)


def run_timm_suite(folder: Path, expression: str, report_dir: Path, patched: bool = True,
                   timeout: float = TIMEOUT_S) -> dict:
    """Run timm's tests/test_models.py in ``folder`` with the plugin: outcome per test id
    ("passed", "failed", "error", "skipped: REASON"), the patched models each made, the
    output and the wall-clock time."""
    junit, created = report_dir / "junit.xml", report_dir / "patched.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", FLASHWIN_TIMM_SUITE_REPORT=str(created), TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if not patched:
        env["FLASHWIN_TIMM_SUITE_UNPATCHED"] = "1"
    for name in [k for k in env if k.startswith("PYTEST_")]:  # the outer run's (xdist worker, addopts)
        del env[name]
    command = [sys.executable, "-m", "pytest", "tests/test_models.py", "-p", "flashwin_plugin", "-k", expression,
               "-c", "pyproject.toml", "--rootdir", ".", "-p", "no:cacheprovider", "-o", "addopts=",
               "-W", "ignore::pytest.PytestUnknownMarkWarning", "-q", "-rfEs", "--durations=10", "--junitxml", str(junit)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"timm's tests ran past {timeout} s:\n{(error.stdout or b'')[-4000:]}") from error
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if not junit.is_file():
        raise AssertionError(f"timm's tests did not run ({done.returncode}):\n{output[-4000:]}")
    outcomes = read_junit(junit)
    made = json.loads(created.read_text()) if created.is_file() else {}
    return dict(outcomes=outcomes, patched=made, output=output, seconds=seconds, returncode=done.returncode)


def read_junit(path: Path) -> dict:
    """Test id -> "passed", "failed", "error" or "skipped: REASON", from a junit XML file."""
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        test_id = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[test_id] = "passed" if child is None else (
            "skipped: " + child.get("message", "") if child.tag == "skipped" else
            "failed" if child.tag == "failure" else "error")
    return outcomes


def compare_runs(unpatched: Path, patched: Path) -> str:
    """Counts of two runs' junit files, and every test that passed unpatched but not patched."""
    before, after = read_junit(unpatched), read_junit(patched)

    def counts(outcomes):
        kinds = [o.split(":")[0] for o in outcomes.values()]
        return ", ".join(f"{kinds.count(k)} {k}" for k in ("passed", "failed", "error", "skipped") if k in kinds)

    lost = sorted(t for t, o in before.items() if o == "passed" and after.get(t) != "passed")
    lines = [f"unpatched: {counts(before)}", f"patched:   {counts(after)}",
             f"passed unpatched, not patched: {len(lost)}"] + [f"  {t}: {after.get(t, 'not run')}" for t in lost]
    return "\n".join(lines)


@pytest.mark.long
def test_timm_model_tests_pass_patched(timm_tests, tmp_path):
    """timm's scripting, tracing, fx, features and input-size tests of the three tiny
    models, every model patched: each passes (or skips for timm's own size limits) and made
    at least one patched model."""
    result = run_timm_suite(timm_tests, selection(), tmp_path)
    outcomes, output = result["outcomes"], result["output"]
    print(f"timm's tests, patched: {len(outcomes)} run in {result['seconds']:.0f} s")
    print(output[output.find("slowest"):][-3000:] if "slowest" in output else output[-3000:])
    bad = {t: o for t, o in outcomes.items() if o != "passed" and not (
        o.startswith("skipped: ") and o[len("skipped: "):].strip() in ALLOWED_SKIPS)}
    assert not bad, f"timm's tests on patched models: {bad}\n{output[-6000:]}"
    for test in REQUIRED_TESTS:
        for model in SUITE_MODELS:
            assert any(test in t and model in t for t in outcomes), f"{test} of {model} was not run:\n{output[-3000:]}"
    passed = [t for t, o in outcomes.items() if o == "passed"]
    patched = result["patched"]
    unpatched = [t for t in passed if not any(t.split("::")[-1] == k.split("::")[-1] for k in patched)]
    assert not unpatched, f"passed without a patched model (the plugin did not patch): {unpatched}"
    assert result["returncode"] == 0, output[-4000:]


if __name__ == "__main__":
    # python tests/test_timm_suite.py --fetch [VERSION]
    # python tests/test_timm_suite.py --compare UNPATCHED.xml PATCHED.xml (junit files of two runs)
    if sys.argv[1:2] == ["--fetch"]:
        version = sys.argv[2] if len(sys.argv) > 2 else __import__("timm").__version__
        print(fetch_timm_tests(version))
    elif sys.argv[1:2] == ["--compare"] and len(sys.argv) == 4:
        print(compare_runs(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
