"""A CUDA out-of-memory inside the kernels' loads and launches is ``torch.OutOfMemoryError``
with "CUDA out of memory." (what batch-size finders and ``except torch.OutOfMemoryError``
look for), after one retry with PyTorch's cached blocks given back; any other CUDA error of
a launch names the kernel and the call (kernels/launch_errors.py). On the CPU with stand-in
kernels that raise what Triton 3.6 to 3.8 raise (``RuntimeError("Triton Error [CUDA]: out of
memory")``); on a GPU with Triton's own module loads failing, and, where the whole GPU may
be taken (``TIMM_FLASHWIN_FILL_GPU_TESTS=1``, run alone), a full GPU and accelerate's
``find_executable_batch_size``."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from timm_flashwin.kernels import fast_launch, launch_errors

OOM = "Triton Error [CUDA]: out of memory"
cuda = pytest.mark.cuda
fills_gpu = pytest.mark.skipif(os.environ.get("TIMM_FLASHWIN_FILL_GPU_TESTS") != "1",
                               reason="takes the whole GPU: run alone, with TIMM_FLASHWIN_FILL_GPU_TESTS=1 and -n 0")
SCRIPT = Path(__file__).resolve().parent / "scripts" / "oom_step.py"


class _Compiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.attempt("direct")


class _Kernel:
    """A JITFunction's stand-in with parameters (x, n, BLOCK) whose loads or launches raise
    ``errors`` in turn (None: succeeds)."""

    arg_names = ["x", "n", "BLOCK"]
    __name__ = "_window_forward_standin"

    def __init__(self, *errors):
        self.errors, self.launches, self.pre_run_hooks = list(errors), [], []

    def attempt(self, how):
        self.launches.append(how)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise RuntimeError(error)

    def run(self, *args, grid, warmup, **kwargs):
        self.attempt("triton")
        return _Compiled(self)


@pytest.fixture
def freed(monkeypatch):
    """Direct launches on, a clean cache, and torch.cuda.empty_cache counted (not run)."""
    calls = []
    monkeypatch.setattr(fast_launch, "_settings_key", lambda: ())
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    fast_launch.clear()
    yield calls
    fast_launch.clear()


def _launch(kernel, x=None):
    x = torch.zeros(4, 49, 96, dtype=torch.bfloat16) if x is None else x
    fast_launch.launch(kernel, (8, 3), (x, 49), dict(BLOCK=64), 0)


def test_out_of_memory_at_the_first_launch_is_retried_after_freeing_the_cache(freed):
    """The module load at a kernel's first launch fails once: the cached blocks are given
    back and the launch made again, which succeeds and is kept for direct launches."""
    kernel = _Kernel(OOM)
    _launch(kernel)
    assert kernel.launches == ["triton", "triton"] and freed == ["empty_cache"]
    _launch(kernel)
    assert kernel.launches[-1] == "direct" and freed == ["empty_cache"]


@pytest.mark.parametrize("when", ["first launch", "direct launch"])
def test_out_of_memory_twice_is_torch_out_of_memory_error_naming_the_kernel(freed, when):
    kernel = _Kernel(*([None] if when == "direct launch" else []), OOM, OOM)
    if when == "direct launch":
        _launch(kernel)
    with pytest.raises(torch.OutOfMemoryError) as info:
        _launch(kernel)
    error = info.value
    assert freed == ["empty_cache"] and len(kernel.launches) == (3 if when == "direct launch" else 2)
    # what accelerate's should_reduce_batch_size reads: a RuntimeError, one argument, the text
    assert isinstance(error, RuntimeError) and len(error.args) == 1 and "CUDA out of memory." in error.args[0]
    message = error.args[0]
    assert message.startswith("CUDA out of memory. timm_flashwin: loading or launching the Triton kernel "
                              "_window_forward_standin (grid (8, 3); tensors (4, 49, 96) bfloat16) on cuda:0")
    assert OOM in message and "torch.cuda.empty_cache()" in message
    assert isinstance(error.__cause__, RuntimeError) and str(error.__cause__) == OOM


def test_other_cuda_errors_name_the_kernel_and_are_not_retried(freed):
    kernel = _Kernel("Triton Error [CUDA]: invalid argument")
    with pytest.raises(RuntimeError) as info:
        _launch(kernel)
    assert not isinstance(info.value, torch.OutOfMemoryError) and freed == [] and kernel.launches == ["triton"]
    assert str(info.value) == ("timm_flashwin: the Triton kernel _window_forward_standin (grid (8, 3); tensors "
                               "(4, 49, 96) bfloat16) on cuda:0 failed: Triton Error [CUDA]: invalid argument")
    # an error that is not the driver's passes as it is
    kernel = _Kernel("Global variable X has changed since we compiled this kernel")
    with pytest.raises(RuntimeError, match="^Global variable X has changed"):
        _launch(kernel)
    assert freed == []


class _HookedKernel(_Kernel):
    """A kernel with pre-run hooks: launched through ``kernel[grid]``, Triton's own path."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.attempt("jit")


def test_launches_through_triton_are_retried_too(freed):
    kernel = _HookedKernel(OOM)
    kernel.pre_run_hooks = [print]
    _launch(kernel)
    assert kernel.launches == ["jit", "jit"] and freed == ["empty_cache"]


class _TritonCompiled:
    """What ``forget_unloaded`` reads of Triton's CompiledKernel."""

    def __init__(self, module, run):
        self.module, self._run = module, run


def test_a_failed_module_load_does_not_leave_triton_a_launcher_without_a_function():
    """Triton's ``_init_handles`` sets the launcher, then loads the module; a load that runs
    out of memory leaves the launcher set and no function, and the next launch would call
    it with a null function. ``forget_unloaded`` drops such launchers (Triton's stored
    OutOfResources errors and loaded kernels are kept)."""
    launcher = object()
    stored = functools.partial(lambda: None)
    half, loaded, refused = _TritonCompiled(None, launcher), _TritonCompiled(1234, launcher), _TritonCompiled(None, stored)
    kernel = type("K", (), {})()
    kernel.device_caches = {0: ({"a": half, "b": loaded, "c": refused}, {}, None, None, None)}
    launch_errors.forget_unloaded(kernel)
    assert half._run is None and loaded._run is launcher and refused._run is stored
    launch_errors.forget_unloaded(object())  # no Triton caches: nothing to do


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_a_call_that_runs_out_of_memory_while_recorded_is_recorded_again_later(grad):
    """A host program's first call that fails (out of memory at a batch that does not fit)
    leaves no signature behind: the next call of that signature records it (it kept the
    Python road for good)."""
    from timm_flashwin.ops import host_program
    x = torch.randn(3, requires_grad=grad)
    key = ("test_a_call_that_runs_out_of_memory_while_recorded", grad)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError):
        host_program.call(key, [x], out_of_memory, grad=grad)
    assert not any(k[0] == key or k[0][0] == key for k in host_program._SIGNATURES)
    host_program.call(key, [x], lambda: x * 2, grad=grad)
    recorded = [k for k in host_program._SIGNATURES if k[0] == key or k[0][0] == key]
    assert len(recorded) == 1
    del host_program._SIGNATURES[recorded[0]]


# --------------------------------------------------------------------------- on a GPU
def _fresh_signature_call(head_dim: int, train: bool = True):
    """A window-attention call of a (N, head_dim) no other test uses: its kernels compile
    and load here (a module load per kernel)."""
    from timm_flashwin import window_attention
    qkv = torch.randn(6, 20, 3 * 2 * head_dim, device="cuda", dtype=torch.float16, requires_grad=train)
    out = window_attention(qkv, 2, scale=head_dim ** -0.5)
    if train:
        out.float().sum().backward()
    return qkv, out


@cuda
def test_gpu_module_load_out_of_memory_is_retried_and_then_raised(monkeypatch):
    """Triton's own module loads (``load_binary``) failing as the driver fails them: once, the
    call succeeds after ``empty_cache``; every time, ``torch.OutOfMemoryError`` naming the
    kernel; and afterwards the same call loads and runs (Triton's state left clean)."""
    from triton.runtime import driver
    from timm_flashwin.ops.reference import window_attention_reference
    utils, real = driver.active.utils, driver.active.utils.load_binary
    failures, freed = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda real_empty=torch.cuda.empty_cache: (freed.append(1),
                                                                                              real_empty()))

    def load_binary(*args):
        if failures and failures.pop(0):
            raise RuntimeError(OOM)
        return real(*args)

    monkeypatch.setattr(utils, "load_binary", load_binary)
    failures[:] = [True]
    qkv, out = _fresh_signature_call(24)
    expected = window_attention_reference(qkv.detach().double(), 2, scale=24 ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)
    assert freed == [1] and failures == []
    failures[:] = [True] * 100
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. timm_flashwin: loading or launching "
                                                     r"the Triton kernel \w+ \(grid"):
        _fresh_signature_call(40, train=False)
    failures[:] = []
    _fresh_signature_call(40, train=False)  # loads now: no launcher left without its function


@cuda
def test_gpu_replayed_launch_errors_name_the_kernel(monkeypatch):
    """A host program's launch that the driver refuses (a grid past its limit, put into the
    program as it is recorded) raises a RuntimeError naming the kernel and its tensors."""
    from timm_flashwin import window_attention
    from timm_flashwin.ops import host_program, native
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    extension, made = native.module(), []
    real = extension.add_signature

    def add_signature(num_slots, steps, *rest):
        steps = [(*s[:2], (s[2][0], 1 << 20, 1), *s[3:]) if s[0] == "launch" else s for s in steps]
        made.append(real(num_slots, steps, *rest))
        return made[-1]

    monkeypatch.setattr(extension, "add_signature", add_signature)
    qkv = torch.randn(7, 16, 3 * 2 * 16, device="cuda", dtype=torch.float16)  # a signature of its own
    try:
        with torch.no_grad():
            window_attention(qkv, 2, scale=0.25)  # recorded
            assert made, "the call was not recorded"
            with pytest.raises(RuntimeError, match=r"^timm_flashwin: the Triton kernel \w+ \(grid \(\d+, 1048576, 1\); "
                                                   r"tensors \[7, 16, 96\] Half.*replayed by a host program\) failed"):
                window_attention(qkv, 2, scale=0.25)  # replayed
    finally:  # the broken program is not left for later calls of the signature
        for key in [k for k, s in host_program._SIGNATURES.items() if s.index in made]:
            del host_program._SIGNATURES[key]


def _run_script(*args: str) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@cuda
@fills_gpu
@pytest.mark.parametrize("variant", ["timm", "flashwin"])
def test_gpu_full_training_step_raises_torch_out_of_memory_error(variant):
    """A swin_tiny's first training step (a patched one's kernels compile and load in it)
    with the GPU's memory all but taken by live tensors: torch.OutOfMemoryError with "CUDA
    out of memory.", patched as unpatched."""
    result = _run_script("step", "--variant", variant)
    assert result["error_type"] == "OutOfMemoryError" and "CUDA out of memory." in result["message"], result


@cuda
@fills_gpu
def test_gpu_find_executable_batch_size_lowers_the_batch_and_finishes():
    """accelerate's find_executable_batch_size over a patched model's training step, from a
    batch that does not fit beside a tensor holding most of the GPU: it lowers the batch
    until one fits and finishes, as it does for timm's unpatched model (accelerate 1.15
    takes 90% of the batch each time, earlier ones half: any decreasing sequence)."""
    pytest.importorskip("accelerate")
    for variant in ("timm", "flashwin"):
        result = _run_script("batch-finder", "--variant", variant)
        tried = result["tried"]
        assert result["finished"] and len(tried) >= 2 and all(a > b for a, b in zip(tried, tried[1:])), result
