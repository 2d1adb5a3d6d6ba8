"""Test setup. Without a CUDA device the Triton kernels run under the interpreter on CPU
tensors; TRITON_INTERPRET must be set before triton is imported (timm imports it), and
``import torch`` alone does not import it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
#: Where the kernel tests run: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def deterministic_algorithms(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` for one test, then the previous setting.
    cuBLAS is deterministic only with a fixed workspace, hence CUBLAS_WORKSPACE_CONFIG
    (PyTorch refuses matmuls on CUDA in this mode without it)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def _patch_the_language_once_per_launch() -> None:
    """Under the interpreter, triton re-patches triton.language (inspect.getmembers over
    the module, about 2 ms) on every call of a @triton.jit helper inside a kernel, though
    the launch already patched the same module objects: a quarter of the time of a
    multi-block test (cProfile, triton 3.8). Inside a launch, a helper whose language
    modules (triton.language, triton.language.core for triton's own helpers) are already
    patched gets an empty patch scope. Where triton's interpreter lacks these names,
    nothing is changed."""
    from triton.runtime import interpreter

    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(interpreter, name) for name in needed):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    language = (interpreter.tl, interpreter.tl.core)
    state = {"launches": 0, "patched": set()}
    modules_of = {}  # id(a function's globals) -> ids of the language modules among them

    def patch_lang_once(fn):
        key = id(fn.__globals__)
        if key not in modules_of:
            modules_of[key] = {id(v) for v in fn.__globals__.values() if any(v is lang for lang in language)}
        modules = modules_of[key]
        if state["launches"] and modules <= state["patched"]:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        scope = patch_lang(fn)
        if state["launches"]:
            state["patched"] |= modules
        return scope

    def launch_and_forget(self, *args, **kwargs):
        state["launches"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["launches"] -= 1
            state["patched"] = set()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_and_forget


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
