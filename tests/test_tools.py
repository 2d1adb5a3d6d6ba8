"""What each model-capturing tool gets from a patched model (docs/support.md, "Tools";
timm_flashwin/tracing.py; torch.func: test_func_transforms.py): torch.export keeps the op in the graph,
TorchScript (script and trace) and ONNX export take timm's forward, torch.fx traces timm's
math or, in timm's fx feature extraction, calls the patched module as a leaf. Tiny models,
the kernels under the interpreter on CPU."""
import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from conftest import KERNEL_DEVICE
from timm_flashwin import is_patched, patch_model, unpatch_model
from timm_flashwin.patching.adapters import base as adapter_base
from timm_flashwin.patching.model import PATCHED_CLASSES
from timm_flashwin.patching.tracing import runs_timm
from timm_flashwin.tools.verify import perturb_

FAMILIES = {  # small enough for the interpreter: a shifted block per stage, masks, two stages
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=28, depths=(2, 2), num_heads=(1, 2), embed_dim=16)),
    "swinv2": ("swinv2_tiny_window8_256", dict(img_size=32, window_size=4, depths=(2, 2), num_heads=(1, 2),
                                               embed_dim=16)),
    "swinv2_cr": ("swinv2_cr_tiny_224", dict(img_size=32, window_size=4, depths=(2, 2), num_heads=(1, 2),
                                             embed_dim=16)),
}
OP = "timm_flashwin.window_attention_fwd"


def create(family: str, **kwargs) -> torch.nn.Module:
    """timm's model, seeded and perturbed (SwinV2's zero-initialized post-norms would hide
    its attention), unpatched, in eval mode, where the kernels run."""
    name, args = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.0, **{**args, **kwargs})
    return perturb_(model, 0).eval().to(KERNEL_DEVICE)


def pair(family: str, **kwargs):
    """(timm's model, a patched copy)."""
    plain = create(family, **kwargs)
    return plain, patch_model(copy.deepcopy(plain))


def images(model_or_size, batch=1, seed=0):
    size = model_or_size.patch_embed.img_size if isinstance(model_or_size, torch.nn.Module) else model_or_size
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE)


@pytest.fixture
def op_calls(monkeypatch):
    """A list that grows by one for every call of the op by a patched module."""
    calls = []
    attention = adapter_base.window_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    monkeypatch.setattr(adapter_base, "window_attention", counted)
    return calls


def assert_still_patched(model, x, op_calls, expected):
    """After a tool ran, the eager model is as patched as before and calls the op."""
    assert is_patched(model)
    del op_calls[:]
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    assert len(op_calls) == 4


def graph_targets(graph_module) -> list:
    return [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]


# ----------------------------------------------------------------------------- eager
def test_eager_calls_run_the_op():
    x = torch.randn(2, 49, 16)
    assert not runs_timm(x)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_forward_has_timms_signature(family):
    """A patched class's forward takes what timm's takes (x, mask), by name: TorchScript
    compiles it, and callers passing ``mask=`` keep working."""
    import inspect
    cls = PATCHED_CLASSES[family]
    assert list(inspect.signature(cls.forward).parameters) == list(inspect.signature(cls.__mro__[1].forward).parameters)


# ------------------------------------------------------------------------- TorchScript
@pytest.mark.parametrize("family", list(FAMILIES))
def test_script_compiles_timms_forward(family, op_calls):
    """torch.jit.script of a patched model compiles timm's forward of every patched module
    and block (``torch.jit.is_scripting()`` in the patched forward): the script module
    computes timm's attention and holds no op, saves and reloads; the eager model stays
    patched and keeps calling the op."""
    plain, model = pair(family)
    x = images(model)
    with torch.no_grad():
        expected = plain(x)
    scripted = torch.jit.script(model)
    assert "timm_flashwin::" not in str(scripted.inlined_graph)
    assert "softmax" in str(scripted.inlined_graph)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    reloaded = torch.jit.load(buffer)
    del op_calls[:]
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reloaded(x), expected, rtol=1e-5, atol=1e-6)
    assert not op_calls
    assert_still_patched(model, x, op_calls, expected)


def test_script_with_timms_scriptable_flag():
    """timm's own route: ``set_scriptable(True)`` around create_model, then script."""
    with timm.layers.set_scriptable(True):
        model = patch_model(create("swin"))
    x = images(model)
    torch.testing.assert_close(torch.jit.script(model)(x), unpatch_model(model)(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trace_records_timms_forward(family, op_calls):
    """torch.jit.trace of a patched model records timm's forward (``torch.jit.is_tracing()``:
    the op would be recorded with the window geometry as Python numbers): the traced graph
    holds no op, and a model with a dynamic mask (``strict_img_size=False``) traced at one
    size runs at another, as timm's."""
    plain, model = pair(family, strict_img_size=False)
    x = images(model)
    traced = torch.jit.trace(model, x, check_trace=False)
    assert "timm_flashwin::" not in str(traced.inlined_graph)
    other = torch.randn(1, 3, 48, 40).to(KERNEL_DEVICE)
    del op_calls[:]
    with torch.no_grad():
        torch.testing.assert_close(traced(other), plain(other), rtol=1e-5, atol=1e-6)
    assert not op_calls
    with torch.no_grad():
        assert_still_patched(model, x, op_calls, plain(x))


# ------------------------------------------------------------------------------ torch.fx
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fx_symbolic_trace_traces_timms_math(family):
    """torch.fx.symbolic_trace (its default tracer, no leaf for ours) traces through a
    patched module, whose forward runs timm's on the proxies: the graph is timm's."""
    plain, model = pair(family)
    x = images(model)
    traced, traced_plain = torch.fx.symbolic_trace(model), torch.fx.symbolic_trace(plain)
    assert not any("timm_flashwin" in t for t in graph_targets(traced))
    assert [n.target for n in traced.graph.nodes] == [n.target for n in traced_plain.graph.nodes]
    with torch.no_grad():
        torch.testing.assert_close(traced(x), plain(x), rtol=1e-5, atol=1e-6)


def attention_leaves(graph_module) -> list:
    return [n.target for n in graph_module.graph.nodes if n.op == "call_module" and n.target.endswith(".attn")]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_timm_fx_feature_extraction_calls_the_patched_modules(family, op_calls):
    """timm's fx feature extraction of a patched model (``FeatureGraphNet``, as
    ``features_only=True, feature_cls="fx"`` builds it; ``timm.layers.create_feature_extractor``):
    its tracer takes the leaf modules timm's registry lists, where patching registers the
    patched classes, so each patched module is a leaf that the GraphModule calls, running
    the op forward and backward; the features and gradients are timm's."""
    from timm.models import FeatureGraphNet
    plain, model = pair(family)
    x = images(model, batch=2)
    features, plain_features = FeatureGraphNet(model, out_indices=(0, 1)), FeatureGraphNet(plain, out_indices=(0, 1))
    assert len(attention_leaves(features.graph_module)) == 4 and not attention_leaves(plain_features.graph_module)
    del op_calls[:]
    torch.manual_seed(1)  # SwinV2-CR's meta_mlp dropout: the same random numbers on both sides
    outputs = features.train()(x)
    torch.manual_seed(1)
    expected = plain_features.train()(x)
    assert len(op_calls) == 4
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    sum(o.square().mean() for o in outputs).backward()
    sum(o.square().mean() for o in expected).backward()
    grads = {n: p.grad for n, p in plain_features.named_parameters()}
    for n, p in features.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5)


def test_fx_graph_traced_before_patching_has_nothing_to_patch():
    """An fx GraphModule traced from an unpatched model (``features_only=True,
    feature_cls="fx"``, then patch_model, as a wrapper of timm.create_model does) computes
    timm's attention inline: it holds the modules' layers and tensors, not the attention
    modules, so patch_model finds nothing, says so (strict raises), and the features stay
    timm's. Patch first, then build the extractor, for the op."""
    name, args = FAMILIES["swin"]
    model = timm.create_model(name, features_only=True, feature_cls="fx", out_indices=(0, 1), **args)
    model = model.eval().to(KERNEL_DEVICE)
    x = images((args["img_size"],) * 2)
    with torch.no_grad():
        expected = model(x)
    with pytest.raises(ValueError, match="no timm window-attention module"):
        patch_model(model, strict=True)
    with pytest.warns(UserWarning, match="no timm window-attention module"):
        patch_model(model)
    with torch.no_grad():
        for out, ref in zip(model(x), expected):
            torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------- torch.export
EXPORT_CASES = [  # (family, train, grad enabled, strict)
    ("swin", False, True, False),  # how users call it: eval mode, grad enabled
    ("swin", False, False, True),
    ("swin", True, True, False),
    ("swin", True, False, False),  # train mode under no_grad: the forward alone, dropout live
    ("swinv2", True, True, False),
    ("swinv2_cr", True, True, False),  # meta_mlp dropout
    ("swinv2_cr", False, False, True),
]


@pytest.mark.parametrize("family,train,grad,strict", EXPORT_CASES, ids=[
    f"{f}-{'train' if t else 'eval'}-{'grad' if g else 'no_grad'}{'-strict' if s else ''}" for f, t, g, s in EXPORT_CASES])
def test_export_keeps_the_op(family, train, grad, strict):
    """torch.export.export (non-strict, its default, or strict: dynamo; grad enabled or not,
    either mode) traces the registered operator into the exported graph, so that
    AOTInductor and other consumers of the program run the kernels; the program's outputs
    are timm's, and in training its gradients are those of the eager patched model (which
    test_patching.py holds to timm's against float64). Not timm's float32 gradients at a
    fixed tolerance: SwinV2-CR's first-layer gradients sit as far from those as timm's own
    float32 ones sit from float64 (4e-5), and whether they passed 1e-5 turned on how the
    interpreter's BLAS rounded (one thread or two). (SwinV2-CR's meta_mlp dropout draws
    the same random numbers on every side.)"""
    plain, model = pair(family)
    plain.train(train), model.train(train)
    eager = copy.deepcopy(model)
    x = images(model, batch=2)
    with torch.set_grad_enabled(grad):
        program = torch.export.export(model, (x,), strict=strict)
    targets = graph_targets(program.graph_module)
    assert sum(t.startswith(OP) for t in targets) == 4
    assert not any("softmax" in t for t in targets)
    torch.manual_seed(1)
    out = program.module()(x)
    torch.manual_seed(1)
    expected = plain(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    if grad and train:
        out.square().mean().backward()
        torch.manual_seed(1)
        eager(x).square().mean().backward()
        grads = {n: p.grad for n, p in eager.named_parameters()}
        for n, p in model.named_parameters():
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_compile_is_not_export(family):
    """Under torch.compile (not export) the patched model takes the compiled road: each
    block's position-bias pairs, sorted by table row, and its window maps are constants
    of the graph, not computed in it at every step. Dynamo up to torch 2.11 answered True
    to ``torch.compiler.is_exporting()`` under torch.compile too (pytorch#176347), which
    put 12 sorts and 24 aranges into a compiled SwinV2-tiny step (``dispatch.exporting``)."""
    from timm_flashwin.ops.dispatch import exporting
    flags = []

    def seen(x):
        flags.append(exporting())
        return x + 1
    torch.compile(seen, backend="eager", fullgraph=True)(torch.zeros(1))
    assert flags == [False]
    _, model = pair(family)
    model.train()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch.compile(model, backend=backend, fullgraph=True)(images(model, batch=2)).sum().backward()
    targets = [t for gm in graphs for t in graph_targets(gm)]
    assert any(t.startswith(OP) for t in targets)
    assert not any(name in t for t in targets for name in ("sort", "arange", "searchsorted")), targets


# --------------------------------------------------------------------------------- ONNX
def onnx_exporting(function):
    """``function`` run as torch.onnx.export's dynamo exporter runs torch.export (with its
    flag set: ``torch.onnx.is_in_onnx_export()`` is True)."""
    from torch.onnx._internal.exporter import _flags
    return _flags.set_onnx_exporting_flag(function)


@pytest.mark.parametrize("family", ["swin", "swinv2_cr"])
def test_onnx_export_takes_timms_graph(family, op_calls):
    """Under ONNX export a patched module runs timm's forward, so that the graph the
    exporters translate is the unpatched model's: the dynamo exporter's torch.export
    (checked without the onnx packages), the TorchScript exporter's trace."""
    plain, model = pair(family)
    x = images(model)
    assert onnx_exporting(torch.onnx.is_in_onnx_export)()
    program = onnx_exporting(torch.export.export)(model, (x,))
    plain_program = torch.export.export(plain, (x,))
    assert graph_targets(program.graph_module) == graph_targets(plain_program.graph_module)
    assert not op_calls
    with torch.no_grad():
        assert_still_patched(model, x, op_calls, plain(x))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript_exporter", "dynamo_exporter"])
def test_onnx_export_matches_the_unpatched_model(dynamo):
    """torch.onnx.export of a patched model gives the unpatched model's ONNX graph, node for
    node (the TorchScript exporter: the same bytes), and onnxruntime computes timm's
    outputs with it. Needs the onnx package (and onnxscript for the dynamo exporter,
    onnxruntime for the outputs): the test extra installs them."""
    onnx = pytest.importorskip("onnx", reason="the onnx package is not installed")
    if dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")
    plain, model = pair("swin")
    x = images(model)

    def export(m):
        if dynamo:
            return torch.onnx.export(m, (x,), dynamo=True, verbose=False).model_proto.SerializeToString()
        buffer = io.BytesIO()
        torch.onnx.export(m, (x,), buffer, dynamo=False)
        return buffer.getvalue()

    patched_bytes, plain_bytes = export(model), export(plain)
    if not dynamo:
        assert patched_bytes == plain_bytes
    nodes = [(n.op_type, n.domain) for n in onnx.load_from_string(patched_bytes).graph.node]
    assert nodes == [(n.op_type, n.domain) for n in onnx.load_from_string(plain_bytes).graph.node]
    assert not any("flashwin" in domain for _, domain in nodes)
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    session = ort.InferenceSession(patched_bytes)
    out = session.run(None, {session.get_inputs()[0].name: x.cpu().numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), plain(x).cpu(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ AOTInductor
AOTI_SCRIPT = Path(__file__).with_name("scripts") / "aoti_package.py"


def _aoti(family: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AOTI_SCRIPT), family], capture_output=True, text=True, timeout=600)


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_aot_inductor_runs_the_kernels(family):
    """An exported patched model compiled by AOTInductor (the op is a triton_op on the GPU:
    its kernels are compiled into the package) computes timm's outputs, with the op in the
    exported graph (tests/scripts/aoti_package.py, in a process of its own). Where loading
    a package kills the process for a model of two torch ops too (torch 2.11 with CUDA 13
    on an H200: a segmentation fault in aoti_load_package), the loader of this machine
    cannot be tested: the package must still have been built, and the test skips, saying
    so; a failure of ours alone fails."""
    result = _aoti(family)
    if result.returncode != 0:
        control = _aoti("control")
        if control.returncode != 0:
            assert "compiled" in result.stdout.split(), result.stdout + result.stderr[-4000:]
            pytest.skip(f"AOTInductor fails on this machine without the op too (exit {control.returncode}, "
                        f"torch {torch.__version__}): {control.stderr.strip().splitlines()[-1:]}")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr[-4000:]
