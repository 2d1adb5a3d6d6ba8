"""pytest plugin: timm's own test suite with every model ``timm.create_model`` returns
patched by ``patch_model`` (strict: every window-attention module of a swin* model).

Load it into a run of timm's tests (this folder and the repository on PYTHONPATH):
``python -m pytest TIMM_SDIST/tests/test_models.py -p flashwin_plugin -k swin``.
tests/test_timm_suite.py runs it so; the README's "Tools" section and that file give the
GPU command.

Environment:
  FLASHWIN_TIMM_SUITE_UNPATCHED=1  wrap create_model but patch nothing (the baseline run)
  FLASHWIN_TIMM_SUITE_DEVICE=cuda  torch.set_default_device(...) before the tests: models
                                   and inputs made on the GPU, where the kernels run (timm's
                                   tests make most of theirs on the CPU; set TORCH_DEVICE
                                   too, which its forward, backward and TorchScript tests read)
  FLASHWIN_TIMM_SUITE_REPORT=PATH  write {test id: patched models it created} there as JSON
Without a GPU the kernels run under Triton's interpreter on CPU tensors, as in our own
tests (TRITON_INTERPRET=1 unless set).
"""
import functools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import timm  # noqa: E402  (after TRITON_INTERPRET: timm imports triton)
import timm.models  # noqa: E402
import timm.models._factory  # noqa: E402

PATCH = os.environ.get("FLASHWIN_TIMM_SUITE_UNPATCHED", "") != "1"
_state = {"test": None, "models": 0, "patched": {}}


def _wrap(create_model):
    @functools.wraps(create_model)
    def create_patched(*args, **kwargs):
        from timm_flashwin import patch_model, patch_report

        model = create_model(*args, **kwargs)
        _state["models"] += 1
        if PATCH and patch_report(model).modules:
            patch_model(model, strict=True)
            test = _state["test"]
            _state["patched"][test] = _state["patched"].get(test, 0) + 1
        return model

    create_patched._flashwin_wrapped = True
    return create_patched


def pytest_configure(config):
    """Before timm's test modules are imported (they bind ``from timm import create_model``)."""
    device = os.environ.get("FLASHWIN_TIMM_SUITE_DEVICE")
    if device:
        torch.set_default_device(device)
    original = timm.models._factory.create_model
    if getattr(original, "_flashwin_wrapped", False):
        return
    wrapped = _wrap(original)
    for module in (timm, timm.models, timm.models._factory):
        module.create_model = wrapped


def pytest_runtest_logstart(nodeid, location):
    _state["test"] = nodeid


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FLASHWIN_TIMM_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_state["patched"], f)


def pytest_terminal_summary(terminalreporter):
    patched = sum(_state["patched"].values())
    terminalreporter.write_line(
        f"timm_flashwin: {_state['models']} models created, {patched} patched"
        + ("" if PATCH else " (FLASHWIN_TIMM_SUITE_UNPATCHED=1)"))
