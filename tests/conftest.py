"""Test setup. Without a CUDA device the Triton kernels run under the interpreter on CPU
tensors; TRITON_INTERPRET must be set before triton is imported (timm imports it), and
``import torch`` alone does not import it."""
import os

# numpy's BLAS (OpenBLAS) runs only the interpreter's tile products here (16 to 128 rows):
# its threads cannot speed them up, and while they wait for work they spin on the cores the
# interpreter and the other pytest-xdist worker need; torch's idle OpenMP threads likewise
# (passive: they sleep; their number, and so torch's results, unchanged). Read when the
# libraries are loaded (``import torch`` loads numpy), hence here. 2 idle cores, -n 2,
# triton 3.8: test_op.py's 12 float32 N = 144 reference cases 47 s -> 28 s.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

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


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test, its tensors freed and the allocator's cached blocks given back:
    parallel workers (``-n``) share one GPU, and a worker that kept the blocks of its
    largest model starved the others (an H100's 80 GB, 12 to 14 workers: out-of-memory
    failures in every full-resolution file)."""
    yield
    if HAS_CUDA and "cuda" in request.keywords:
        import gc
        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    # The tests marked ``long`` first (the order otherwise kept): with -n, a test of 20 s to 60 s
    # that started last kept one worker busy while the other, its queue and the queue it
    # could steal from empty, waited (CI's 2 cores: the sm_90 builds, timm's suite).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


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


def _launch_at_the_bottom_of_a_fresh_stack() -> None:
    """Under the interpreter, run each kernel launch in a thread of its own, which the
    caller waits for. CPython 3.11 keeps a thread's Python frames in chunks of 16 KiB that
    it maps when a call finds no room and unmaps as soon as that call returns: where the
    interpreter's calls and returns, several per operation, cross a chunk's end, each
    crossing maps a chunk and faults its pages in. Launched from the depth of a test, a
    timm model and autograd, some launches sat on such a boundary (tests/test_cli.py's
    SwinV2-CR verify: 5.6 M page faults, 39 s of system time in a 59 s test; perf put 95%
    of the faults in CPython's frame push). Begun at the bottom of a new thread's stack,
    a launch runs at depths set by its kernel alone, the same in every test; measured on
    CPython 3.11 with triton 3.9: that test 14 s, the whole suite on 2 cores 9:50 -> 8:09
    (system time 202 -> 25 s). Exceptions reach the caller, and launches stay sequential:
    the caller blocks until the thread ends."""
    import threading

    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_in_a_thread(self, *args, **kwargs):
        outcome = {}

        def run():
            try:
                outcome["result"] = launch(self, *args, **kwargs)
            except BaseException as error:  # re-raised in the caller
                outcome["error"] = error

        thread = threading.Thread(target=run, name="triton-interpreter-launch")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    interpreter.GridExecutor.__call__ = launch_in_a_thread


def _round_to_bfloat16_as_the_gpu_does() -> None:
    """Under the interpreter, round float32 -> bfloat16 casts to nearest (ties to even), as
    the GPU's cvt.rn.bf16.f32 does. Triton's interpreter (3.6 to 3.9) truncates them: its
    cast passes no rounding mode and drops the low 16 bits, so every P rounded for the
    P V product, every bf16 output and gradient stored, came out up to one ulp low (0.99999994
    became 0.99609375, not 1.0). That made the kernels' bf16 results under the interpreter
    less accurate than on the GPU and different from them: a forward of window 12 (bf16,
    tests/opcases.py's inputs) had a relative error of 4.1e-3 against float64 here, 1.8e-3
    rounded as the GPU rounds (measured 2026-11-25 at 883bebe; an H100 on
    window 16: 2.0e-3). torch's conversion rounds as the GPU does (NaN,
    infinities, overflow and subnormals included: test_op.py checks both against it).
    Where triton's interpreter lacks these names, nothing is changed."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder, handle = getattr(interpreter, "InterpreterBuilder", None), getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "cast_impl"):
        return
    cast = builder.cast_impl

    def cast_rounding_to_nearest(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32))
            return handle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_rounding_to_nearest


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    _launch_at_the_bottom_of_a_fresh_stack()
    _round_to_bfloat16_as_the_gpu_does()
