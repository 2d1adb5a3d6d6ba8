"""Host programs (timm_flashwin/ops/host_program.py): the recorder, on the CPU (the op's calls
recorded as a GPU's would be) and on a GPU (its ATen calls replayed in C++), and the
signatures' keys. Replays against the Python road: test_host_program_replay.py."""
import sys

import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from host_program_cases import CASES, case_call, shift_mask
from test_position_bias import relative_position_index
from timm_flashwin import TableBias, window_attention
from timm_flashwin.kernels.local.launch import LocalInputs
from timm_flashwin.ops import host_program, native
from timm_flashwin.ops.host_recorder import Recorder
from timm_flashwin.kernels.window.call import DENSE_BIAS, TABLE_BIAS, WindowTensors
from timm_flashwin.kernels.window.plan import call_plan
from timm_flashwin.ops.position_bias import TableRows
from window_calls import window_call

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def test_recorder_notes_calls_with_inputs_and_results_as_slots():
    x, unused = torch.randn(4, 5, 6), None
    with Recorder([x, unused]) as recorder:
        partial = x.sum(0)
        half = partial[:2].view(-1).to(torch.bfloat16)
    assert recorder.failure is None
    names = [step[1] for step in recorder.steps]
    assert names == ["aten::sum", "aten::slice", "aten::view", "aten::_to_copy"]
    assert recorder.steps[0][4][0] == 0  # x: the first input's slot
    assert recorder.slot(partial) == 2 and recorder.slot(half) == recorder.num_slots - 1
    # a call's constants in the schema's order, defaults filled in
    assert recorder.steps[0][3][1:3] == [[0], False]


def test_recorder_refuses_tensors_from_outside_and_values_read_back():
    x, outside = torch.randn(3), torch.randn(3)
    with Recorder([x]) as recorder:
        x + outside
    assert "neither an input" in recorder.failure
    with Recorder([x]) as recorder:
        float(x.sum())
    assert "returns" in recorder.failure


class _Compiled:
    """What the recorder reads of a compiled Triton kernel."""

    def __init__(self, signature, **metadata):
        from types import SimpleNamespace
        self.src = SimpleNamespace(signature=signature)
        self.metadata = SimpleNamespace(**{"num_warps": 4, "shared": 1024, "num_ctas": 1, "global_scratch_size": 0,
                                           **metadata})
        self.function = 0xF00


def _kernel(*names):
    from types import SimpleNamespace
    return SimpleNamespace(arg_names=list(names), fn=SimpleNamespace(__name__="k"))


def test_recorder_notes_launches_by_the_compiled_signature():
    """Pointers become slots (or null), scalars take the width of the compiled signature,
    parameters Triton specialized away (constexpr) are dropped, two null scratch pointers
    close the list; a runtime parameter passed by keyword, scratch memory or a tensor from
    outside refuse the recording."""
    from timm_flashwin.ops import host_recorder as hp
    x = torch.randn(4)
    kernel = _kernel("x", "y", "n", "one", "scale", "BLOCK")
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32", "one": "constexpr", "scale": "fp32", "BLOCK": "constexpr"}
    with Recorder([x]) as recorder:
        y = torch.empty_like(x)
        hp.fast_launch.RECORD(kernel, _Compiled(signature), (3,), (x, y, 7, 1, 0.5))
    assert recorder.failure is None
    launch = recorder.steps[-1]
    assert launch[:5] == ("launch", 0xF00, (3, 1, 1), 128, 1024)
    assert launch[5] == [(hp.PARAM_SLOT, 0, 0.0), (hp.PARAM_SLOT, recorder.slot(y), 0.0), (hp.PARAM_I32, 7, 0.0),
                         (hp.PARAM_F32, 0, 0.5), (hp.PARAM_NULL, 0, 0.0), (hp.PARAM_NULL, 0, 0.0)]
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x", "n"), _Compiled({"x": "*fp32", "n": "i32"}), (1,), (x,))
    assert "by keyword" in recorder.failure
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x"), _Compiled({"x": "*fp32"}, global_scratch_size=64), (1,), (x,))
    assert "does not make" in recorder.failure
    outside = torch.randn(2)
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x"), _Compiled({"x": "*fp32"}), (1,), (outside,))
    assert "neither an input" in recorder.failure
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x"), None, (1,), (x,))
    assert "Triton's own path" in recorder.failure
    # the interpreter's launches (the CPU tests): no step, but their tensors are checked
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x"), hp.fast_launch.INTERPRETED, (1,), (x, 3))
    assert recorder.failure is None and recorder.steps == []
    with Recorder([x]) as recorder:
        hp.fast_launch.RECORD(_kernel("x"), hp.fast_launch.INTERPRETED, (1,), (x, outside))
    assert "neither an input" in recorder.failure
    assert hp.fast_launch.RECORD is None  # switched off on leaving


@pytest.mark.parametrize("op", ["window", "window_gathered_table", "local", "local_decomposed_bias"])
def test_op_calls_are_recorded_up_to_their_launches(op):
    """An eager call's forward and backward record to the end: every tensor they touch is an
    input, a saved tensor or made in the call; so does a call without a gradient (its forward
    alone). On the CPU (the interpreter makes no launch that can be recorded) the recording
    then stops for want of launches alone, each launch's tensors checked as on a GPU.
    ``window_gathered_table``: windows of 144 tokens (the kernels of both passes stream key
    blocks) whose ``TableBias`` the op gathers, 16-bit: the gather reads the index the
    program takes as an input (it read the module's own index, which stopped every such
    recording), and the backward's launches read the float16 bias copy that the forward
    made and saved (kept on the gathered bias only, the backward's recording did not know
    it). ``local_decomposed_bias``: the local operator with a decomposed relative-position
    bias, whose terms are inputs that take gradients."""
    from timm_flashwin.ops import local_operators, window as window_op
    if HAS_CUDA and native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(KERNEL_DEVICE).requires_grad_()  # noqa: E731
    if op == "window":
        qkv, bias = randn(4, 9, 3 * 2 * 8), randn(2, 9, 9)
        call = window_call(9, 8, torch.float32, False, windows=4, heads=2, bias=DENSE_BIAS, scale=0.3)
        inputs = WindowTensors(qkv, None, bias, None, None, None, None, None, None)
    elif op == "window_gathered_table":
        qkv = torch.randn(2, 144, 3 * 2 * 16, generator=generator).to(KERNEL_DEVICE, torch.bfloat16).requires_grad_()
        table = randn(23 * 23, 2)
        rows = TableRows.of(relative_position_index(12, 12).to(KERNEL_DEVICE), table.shape[0])
        call = window_call(144, 16, torch.bfloat16, False, windows=2, heads=2, bias=TABLE_BIAS, scale=0.25)
        inputs = WindowTensors(qkv, None, table, None, None, None, rows.index32, rows.order, rows.offsets)
    if op.startswith("window"):
        plan = call_plan(call)
        tensors = [t for t in inputs if t is not None]
        road = lambda: window_op._EagerWindowAttention.apply(call, plan, *inputs)[0]  # noqa: E731
        forward_alone = lambda: window_op._forward_without_grad(call._replace(save_stats=False), plan,  # noqa: E731
                                                                inputs)
    else:
        q, k, v = (randn(1, 2, 20, 16) for _ in range(3))
        bias = (randn(1, 2, 20, 4), randn(1, 2, 20, 5)) if op == "local_decomposed_bias" else (None, None)
        inputs = LocalInputs(q, k, v, None, *bias)
        args = local_operators.LocalArgs((1, 8, 1, 0), 0.25, 0.0, 5 if bias[0] is not None else 0)
        tensors = local_operators.host_inputs(inputs)
        road = lambda: local_operators.EagerLocalAttention.apply(q, k, v, *bias, None, args)[0]  # noqa: E731
        forward_alone = lambda: local_operators.forward_without_grad(inputs, args)  # noqa: E731
    key = ("test_op_calls_are_recorded_up_to_their_launches", op)
    out = host_program.call(key, tensors, road)
    signature = host_program._SIGNATURES.pop((key, True))
    assert signature.failure is None and signature.forward is not None
    out.backward(torch.ones_like(out))  # recorded from a dense gradient (a sum's is expanded)
    if HAS_CUDA:
        assert signature.failure is None and signature.index is not None
    else:
        assert signature.failure == "no launch, or launches on two devices"
    with torch.no_grad():
        host_program.call(key, tensors, forward_alone, grad=False)
    signature = host_program._SIGNATURES.pop((key, False))
    if HAS_CUDA:
        assert signature.failure is None and signature.index is not None
    else:
        assert signature.failure == "no launch"


@pytest.fixture
def cpu_recordings(monkeypatch):
    """The op's CPU calls recorded as a GPU's are (``host_program.takes`` forced); yields a
    function that gives the failures of the signatures recorded since, sorted; those
    signatures are forgotten afterwards."""
    monkeypatch.setattr(host_program, "takes", lambda tensor: True)
    before = set(host_program._SIGNATURES)
    recorded = lambda: [key for key in host_program._SIGNATURES if key not in before]  # noqa: E731
    yield lambda: sorted(host_program._SIGNATURES[key].failure for key in recorded())
    for key in recorded():
        del host_program._SIGNATURES[key]


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU these cases replay (the next test)")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replay_cases_record_to_their_launches_on_the_cpu(case, cpu_recordings):
    """Each case of the GPU's replay test, through the op, records on the CPU up to the
    want of launches that can be replayed: every tensor of its ATen calls and of the
    interpreter's launches (``fast_launch.INTERPRETED``) is an input, saved or made in the
    call, forward and backward."""
    case_call(case)()
    assert cpu_recordings() == ["no launch, or launches on two devices"]


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the replay tests hold this")
def test_a_mask_kept_by_one_signature_serves_the_next_one_on_the_cpu(cpu_recordings):
    """Where the kernels read a mask's region ids (float32, windows over 64 tokens), they are
    kept on the mask and taken by the host programs as inputs: a second signature of the same
    mask (another batch size, a call without gradient) records too. It did not (a value kept
    by an earlier call), and the first stopped at the ids' ``torch.cat``."""
    generator = torch.Generator().manual_seed(0)
    mask = shift_mask(4, 144).to(KERNEL_DEVICE)
    table = torch.randn(23 * 23, 1, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    bias = TableBias(table, relative_position_index(12, 12).to(KERNEL_DEVICE), constant_index=True)
    for windows in (4, 8):
        qkv = torch.randn(windows, 144, 3 * 16, generator=generator).to(KERNEL_DEVICE).requires_grad_()
        window_attention(qkv, 1, bias=bias, mask=mask, scale=0.25).sum().backward()
        with torch.no_grad():
            window_attention(qkv, 1, bias=bias, mask=mask, scale=0.25)
    assert cpu_recordings() == ["no launch"] * 2 + ["no launch, or launches on two devices"] * 2


@cuda
@needs_cuda
def test_recorded_aten_calls_replay_in_cpp():
    """The C++ side's ATen calls (``run_steps``): each recorded call's constants, dtypes and
    defaults included, gives the Python call's result on new inputs."""
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    x = torch.randn(4, 5, 6, device="cuda")
    with Recorder([x]) as recorder:
        partial = x.sum(0)
        half = partial[:2].view(-1).to(torch.bfloat16)
        fresh = x.new_empty((3, 2), dtype=torch.int32)
    assert recorder.failure is None
    y = torch.randn_like(x)
    slots = native.module().run_steps(recorder.num_slots, recorder.steps, [y])
    assert torch.equal(slots[recorder.slot(partial)], y.sum(0))
    assert torch.equal(slots[recorder.slot(half)], y.sum(0)[:2].view(-1).to(torch.bfloat16))
    made = slots[recorder.slot(fresh)]
    assert made.shape == (3, 2) and made.dtype == torch.int32 and made.device == y.device


def test_a_tensor_passed_for_several_inputs_keys_a_signature_of_its_own():
    """attend(x, x, x): the recorder maps one tensor to one slot, so a program recorded from
    such a call must serve only calls that alias the same inputs."""
    x, y, z = torch.randn(2), torch.randn(2), torch.randn(2)
    key = ("k",)
    assert host_program.with_aliases(key, [x, y, z]) == key
    aliased = host_program.with_aliases(key, [x, y, y])
    assert aliased != key and aliased == host_program.with_aliases(key, [z, x, x])
    assert aliased != host_program.with_aliases(key, [x, x, y])


def test_switched_off_restores_the_previous_setting():
    with host_program.switched_off():
        assert not host_program.available()
        with host_program.switched_off():
            pass
        assert host_program.ENABLED is False
    assert host_program.ENABLED is True
    with pytest.raises(RuntimeError), host_program.switched_off():
        raise RuntimeError
    assert host_program.ENABLED is True


def test_dense_output_gradients_of_any_layout_are_recorded():
    """The backward is recorded with the output's gradient in any dense layout (its strides
    kept; the local operator's output is in q's): contiguous, transposed and with dimensions
    of one; not an expanded one (stride 0) nor one with gaps."""
    g = torch.randn(2, 5, 4, 8)
    assert host_program._dense(g) and host_program._dense(g.transpose(1, 2))
    assert host_program._dense(torch.randn(2, 1, 4, 8).transpose(0, 1))
    assert not host_program._dense(torch.randn(1, 1, 4, 8).expand(2, 5, 4, 8))
    assert not host_program._dense(g[..., :4])


def _fresh_extension_state(monkeypatch, tmp_path, load=None):
    """native's state reset, torch's cache in ``tmp_path`` (TORCH_EXTENSIONS_DIR/NAME/NAME.so)
    and torch's build replaced by ``load`` (by default: fails the test if called)."""
    from torch.utils import cpp_extension

    def must_not_build(name, **kwargs):
        raise AssertionError("cpp_extension.load was called")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TIMM_FLASHWIN_HOST_PROGRAMS", "1")
    monkeypatch.setenv("CXX", sys.executable)  # a program that exists: the compiler check passes anywhere
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", load or must_not_build)
    monkeypatch.setattr(native, "_state", {})


def test_the_extension_build_is_announced_and_can_run_ahead(monkeypatch, capsys, tmp_path):
    """The build (about a minute, on the first eager call on a GPU) says a line when it starts,
    with how to build ahead of time or switch it off, and one when it ends, into the cache
    folder named for this source, torch and Python; switched off, nothing is built. torch's
    build is replaced here."""
    import timm_flashwin
    built, loads = object(), []
    _fresh_extension_state(monkeypatch, tmp_path, lambda name, **kwargs: loads.append((name, kwargs)) or built)
    capsys.readouterr()  # what importing cpp_extension may log (no CUDA runtime found)
    assert timm_flashwin.build_extensions() is True and native.module() is built and len(loads) == 1
    name, kwargs = loads[0]
    assert name == native.extension_name() and kwargs["build_directory"] == str(tmp_path / name)
    start, end = capsys.readouterr().err.splitlines()
    assert start.startswith("timm_flashwin: building the host-program extension (C++, about a minute")
    assert "timm_flashwin.build_extensions()" in start and "TIMM_FLASHWIN_HOST_PROGRAMS=0" in start
    assert end.startswith("timm_flashwin: host-program extension built in ")

    monkeypatch.setenv("TIMM_FLASHWIN_HOST_PROGRAMS", "0")
    monkeypatch.setattr(native, "_state", {})
    assert timm_flashwin.build_extensions() is False and len(loads) == 1 and capsys.readouterr().err == ""


def _compile_stand_in(path, name: str) -> None:
    """A minimal CPython extension module ``name`` at ``path``, built with the C compiler: what
    a finished build is to the loader."""
    import shutil
    import subprocess
    import sysconfig
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in extension")
    source = path.parent / "stand_in.c"
    source.write_text("#include <Python.h>\n"
                      f"static struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, \"{name}\", NULL, -1, NULL}};\n"
                      f"PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&m); }}\n")
    subprocess.run([compiler, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o",
                    str(path)], check=True, capture_output=True)
    source.unlink()


def test_a_finished_build_loads_from_a_read_only_folder(monkeypatch, capsys, tmp_path):
    """A build made ahead of time (a Docker image, a shared read-only home) is imported as it
    is: torch's loader is not called (it takes a lock file in the folder, and a read-only
    folder made every eager GPU call take the Python road), nothing is written, nothing is
    said. The build's name holds the torch version: another torch's build is not this one."""
    from torch.utils import cpp_extension
    _fresh_extension_state(monkeypatch, tmp_path)
    name = native.extension_name()
    folder = tmp_path / name
    folder.mkdir()
    _compile_stand_in(folder / f"{name}{cpp_extension.LIB_EXT}", name)
    before = sorted(p.name for p in folder.iterdir())
    folder.chmod(0o555)
    try:
        capsys.readouterr()
        assert native.build_extensions() is True and native.module().__name__ == name
        assert sorted(p.name for p in folder.iterdir()) == before and capsys.readouterr().err == ""
    finally:
        folder.chmod(0o755)
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    assert native.extension_name() != name


def test_no_build_possible_says_why_in_one_line_once(monkeypatch, capsys, caplog, tmp_path):
    """No compiler, a folder that cannot be written, or a failed build: one warning line naming
    the reason and TIMM_FLASHWIN_HOST_PROGRAMS=0 (not the build notice, the compiler's
    banner and ninja's log), once per process; a failed build's whole output is kept in a
    file the line names."""
    import logging
    import re

    def failed_build(name, **kwargs):
        raise RuntimeError("Error building extension 'x':\n[1/2] c++ -c host_program.cpp\nerror: no\n" * 4)
    cases = {"compiler": None, "folder": None, "build": failed_build}
    (tmp_path / "a_file").write_text("")
    for case, load in cases.items():
        _fresh_extension_state(monkeypatch, tmp_path / case, load)
        if case == "compiler":
            monkeypatch.setenv("CXX", "no-such-compiler-here")
        if case == "folder":  # a folder under a file: not writable, whoever runs the test
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a_file" / "cache"))
        capsys.readouterr()
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            caplog.clear()
            assert native.build_extensions() is False and native.build_extensions() is False
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "\n" not in lines[0] and "TIMM_FLASHWIN_HOST_PROGRAMS=0" in lines[0], (case, lines)
        assert capsys.readouterr().err.count("building the host-program extension") == (case == "build")
        cases[case] = lines[0]
    assert "no C++ compiler (no-such-compiler-here)" in cases["compiler"]
    assert "cannot be written there (NotADirectoryError" in cases["folder"] and "build_extensions()" in cases["folder"]
    assert "building their extension failed: RuntimeError: Error building extension 'x':" in cases["build"]
    log = re.search(r"the build's output: (\S+failed_build\.log)", cases["build"]).group(1)
    assert open(log).read().count("error: no") == 4
