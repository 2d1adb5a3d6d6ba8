"""The registered operators and the roads to the kernels: softmax statistics saved only
for a backward, opcheck, the eager direct path against the operator, fake tensors,
torch.compile without graph break, the plain-CPU and float64 PyTorch paths."""

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import assert_matches_reference, forward_backward, make_case, reference_forward_backward
from timm_flashwin import window_attention
from timm_flashwin.ops.dispatch import uses_kernels
from timm_flashwin.ops.window_operators import window_attention_fwd


def _record_stats_shapes(monkeypatch):
    """The shape of the softmax statistics of every forward the op launches."""
    from timm_flashwin.ops import window, window_operators
    shapes = []
    real = window.attention_forward

    def forward(*args, **kwargs):
        result = real(*args, **kwargs)
        shapes.append(tuple(result[1].shape))
        return result
    for road in (window, window_operators):  # eager, and the registered operators
        monkeypatch.setattr(road, "attention_forward", forward)
    return shapes


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_forward_saves_softmax_statistics_only_for_a_backward(cosine, monkeypatch):
    """Windows over 64 tokens: the forward saves the softmax statistics (and, for cosine
    attention, sums the rows' mean score) only where a gradient can follow; the output is
    the same either way, and a backward without them is refused by name."""
    shapes = _record_stats_shapes(monkeypatch)
    case = make_case(4, 2, 3, 144, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    saved = (4 if cosine else 2, 4, 3, 144)
    kwargs = case.kwargs()
    qkv = case.qkv.detach()
    with_grad = window_attention(qkv.clone().requires_grad_(), 3, **kwargs)
    with torch.no_grad():
        no_grad = window_attention(qkv.clone().requires_grad_(), 3, **kwargs)
    nothing_requires_grad = window_attention(qkv, 3, **{k: v.detach() if torch.is_tensor(v) else v
                                                        for k, v in kwargs.items()})
    only_bias = window_attention(qkv, 3, **dict(kwargs, bias=case.bias.detach().requires_grad_()))
    assert shapes == [saved, (0,), (0,), saved]
    for out in (no_grad, nothing_requires_grad, only_bias):
        torch.testing.assert_close(out, with_grad.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="saved no softmax statistics"):
        _backward_of_a_forward_without_statistics(case, cosine)


def _backward_of_a_forward_without_statistics(case, cosine: bool) -> None:
    """A backward run on what a forward saved where nothing required a gradient."""
    from timm_flashwin.kernels.window.call import DENSE_BIAS, WindowSaved, WindowTensors
    from timm_flashwin.kernels.window.launch import attention_backward, attention_forward
    from timm_flashwin.kernels.window.plan import backward_plan, forward_plan
    from window_calls import window_call
    call = window_call(144, 16, torch.float32, cosine, windows=4, heads=3, bias=DENSE_BIAS, periods=2,
                       save_stats=False, scale=case.scale or 1.0)
    logit_scale = case.logit_scale.reshape(3) if cosine else None
    tensors = WindowTensors(case.qkv.detach(), None, case.bias, case.mask, logit_scale, None, None, None, None)
    outputs = attention_forward(call, forward_plan(call), tensors)
    saved = WindowSaved(tensors.qkv, None, tensors.bias, tensors.mask, tensors.logit_scale, None, *outputs, None, None,
                        None, None, None)
    attention_backward(call, backward_plan(call, True, cosine), saved, case.grad_out)


def test_the_operators_are_registered_and_their_statistics_take_no_gradient():
    """``torch.ops.timm_flashwin`` holds both operators (what an exported program loads), and
    the forward's softmax statistics and region ids are marked non-differentiable: a loss on
    them is refused by autograd, while the output's gradient flows."""
    case = make_case(2, 2, 2, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    assert torch.ops.timm_flashwin.window_attention_fwd.default is window_attention_fwd._opoverload
    assert callable(torch.ops.timm_flashwin.window_attention_bwd.default)
    qkv = case.qkv.detach().requires_grad_()
    out, stats, regions, mask_info = window_attention_fwd(qkv, 2, case.bias, case.mask, None, case.scale, False,
                                                          0.0, None)
    assert stats.shape == (2, 2, 2, 144) and not stats.requires_grad and not regions.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        stats.sum().backward()
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_opcheck(cosine):
    """Schema, fake tensor, autograd registration and AOT dispatch of the operator."""
    case = make_case(2, 2, 2, 9, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    logit_scale = case.logit_scale.reshape(2).requires_grad_() if cosine else None
    args = (case.qkv.requires_grad_(), 2, case.bias.requires_grad_(), case.mask, logit_scale,
            case.scale or 1.0, cosine, 0.0, None)
    torch.library.opcheck(window_attention_fwd, args)
    seed = torch.tensor([1234], dtype=torch.int64, device=KERNEL_DEVICE)  # with attention dropout
    torch.library.opcheck(window_attention_fwd, args[:-2] + (0.25, seed))


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_eager_path_equals_the_operator(cosine, monkeypatch):
    """In eager mode the kernels run through an autograd.Function without the operator
    dispatch; its outputs and every gradient are bit-equal to the registered operator's,
    and it leaves no graph for a second backward."""
    from timm_flashwin.ops import window as op
    case = make_case(4, 2, 3, 16, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    ops_called = []
    real_op = op.window_attention_fwd
    monkeypatch.setattr(op, "window_attention_fwd", lambda *a: ops_called.append(1) or real_op(*a))
    eager = forward_backward(window_attention, case)
    assert not ops_called
    monkeypatch.setattr(op, "dispatch_free", lambda qkv: False)
    dispatched = forward_backward(window_attention, case)
    assert ops_called
    assert all(torch.equal(a, b) for a, b in zip(eager, dispatched))
    qkv = case.qkv.detach().requires_grad_()
    monkeypatch.undo()
    out = window_attention(qkv, 3, **case.kwargs())
    (grad,) = torch.autograd.grad(out.square().sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


@pytest.mark.parametrize("n", [16, 144], ids=["one-tile", "multi-block"])
def test_eager_forward_without_gradients_skips_autograd(n, monkeypatch):
    """Where nothing can take a gradient (no_grad, or no input requiring one) the eager
    forward runs without a torch.autograd.Function (host time of small inference calls):
    no autograd node, and the output bit-equal to the forward that saves statistics for a
    backward."""
    from timm_flashwin.ops import host_program, window as op
    monkeypatch.setattr(host_program, "ENABLED", False)  # the Python road (a replay takes none of it)
    case = make_case(4, 2, 3, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    applied = []
    real_apply = op._EagerWindowAttention.apply
    monkeypatch.setattr(op._EagerWindowAttention, "apply", lambda *a: applied.append(1) or real_apply(*a))
    qkv = case.qkv.detach().requires_grad_()
    with_grad = window_attention(qkv, 3, **case.kwargs())
    assert applied and with_grad.grad_fn is not None
    applied.clear()
    with torch.no_grad():
        no_grad = window_attention(qkv, 3, **case.kwargs())
    plain = window_attention(case.qkv.detach(), 3, **{k: v.detach() if isinstance(v, torch.Tensor) else v
                                                     for k, v in case.kwargs().items()})
    assert not applied and no_grad.grad_fn is None and plain.grad_fn is None
    assert torch.equal(no_grad, with_grad.detach()) and torch.equal(plain, with_grad.detach())


def test_fake_tensors_take_the_operator():
    """Under FakeTensorMode (shape propagation, memory estimates) the registered
    operator's fake implementation answers; no kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from timm_flashwin.ops.dispatch import dispatch_free
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    assert dispatch_free(case.qkv)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        qkv = mode.from_tensor(case.qkv)
        assert not dispatch_free(qkv)
        out = window_attention(qkv, 3, bias=mode.from_tensor(case.bias), mask=mode.from_tensor(case.mask),
                               logit_scale=mode.from_tensor(case.logit_scale))
    assert out.shape == (4, 16, 48)


def test_compiles_without_graph_break():
    """dynamo traces a function calling the op in one graph (fullgraph) and autograd
    goes through the registered backward."""
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    fn = torch.compile(window_attention, fullgraph=True, backend="aot_eager")
    results = forward_backward(fn, case)
    assert_matches_reference(results, reference_forward_backward(case), 1e-4)


def test_compiles_with_symbolic_float_arguments():
    """torch.compile(dynamic=True) without float specialization hands the ops symbolic
    floats (``scale``, a ``TableBias``'s ``sigmoid_scale``): their checks trace (the
    sigmoid scale's finiteness check failed to), and a second value gives its own result."""
    from timm_flashwin import TableBias, sliding_window_attention
    from test_position_bias import relative_position_index

    def window(qkv, table, index, scale, sigmoid_scale):
        return window_attention(qkv, 2, bias=TableBias(table, index, sigmoid_scale), scale=scale)

    def local(q, k, v, scale):
        return sliding_window_attention(q, k, v, window=(3, 2), scale=scale)
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(4, 16, 3 * 2 * 16, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    table = torch.randn(49, 2, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    index = relative_position_index(4, 4).to(KERNEL_DEVICE)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=generator).to(KERNEL_DEVICE) for _ in range(3))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(specialize_float=False):
            compiled = [torch.compile(f, dynamic=True, fullgraph=True, backend="aot_eager") for f in (window, local)]
            for scale, sigmoid_scale in ((0.25, 16.0), (0.3, 12.0)):
                got = compiled[0](qkv, table, index, scale, sigmoid_scale)
                torch.testing.assert_close(got, window(qkv, table, index, scale, sigmoid_scale), rtol=1e-6,
                                           atol=1e-6)
                got.sum().backward()
                torch.testing.assert_close(compiled[1](q, k, v, scale), local(q, k, v, scale), rtol=1e-6, atol=1e-6)
    finally:
        torch._dynamo.reset()  # its dynamic-shape graphs are no other test's


def test_compiled_inference_saves_no_statistics(monkeypatch):
    """Compiled under no_grad, the multi-block forward is traced without softmax
    statistics (the grad mode is a guard of the graph); trained, with them."""
    shapes = _record_stats_shapes(monkeypatch)
    case = make_case(4, 2, 3, 144, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    torch._dynamo.reset()
    fn = torch.compile(window_attention, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = fn(case.qkv, 3, **case.kwargs())
    assert shapes and all(shape == (0,) for shape in shapes)
    shapes.clear()
    results = forward_backward(fn, case)
    assert (4, 4, 3, 144) in shapes
    torch.testing.assert_close(out, results[0].detach(), rtol=1e-6, atol=1e-7)


def test_plain_cpu_path_matches_reference(monkeypatch):
    """Without the interpreter, CPU tensors go through PyTorch with the same result."""
    from timm_flashwin.ops import window as op
    monkeypatch.setattr(op, "uses_kernels", lambda qkv: False)
    case = make_case(4, 2, 3, 49, 16, cosine=True, masked=True, dtype=torch.float32, device="cpu")
    # PyTorch's own float32 math: its logit-scale gradient, a cancelling sum, is 1.0e-5 off
    # float64 on this case, the rest within 2.5e-6
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case), 2e-5)


def test_float64_runs_in_pytorch():
    case = make_case(4, 2, 3, 9, 16, cosine=False, masked=True, dtype=torch.float64, device=KERNEL_DEVICE,
                     param_dtype=torch.float64)
    assert not uses_kernels(case.qkv)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case), 1e-12)


def _record_traced_launches(monkeypatch):
    """The tensor arguments of every launch, with the launchers told they are traced for
    torch.compile (under the interpreter the kernels still run as Python)."""
    from timm_flashwin.kernels.window import bias_mask, launch
    from timm_flashwin.kernels import launcher as launcher_module
    from timm_flashwin.kernels.local import launch as local_launch
    launches, real = [], launcher_module.launcher

    def recording(kernel):
        class Recorded:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launches.append((kernel.__name__, [a for a in args if isinstance(a, torch.Tensor)]))
                    return real(kernel)[grid](*args, **kwargs)
                return run
        return Recorded()

    for module in (launch, bias_mask, local_launch):
        monkeypatch.setattr(module, "traced_launch", lambda: True)
        monkeypatch.setattr(module, "launcher", recording)
    return launches


def _tensors_passed_twice(launches) -> list:
    """(kernel, shape) of each tensor with elements that a launch passes under more than one
    parameter (``launcher.unused_pointer``'s empty tensors may stand in for several)."""
    twice = []
    for kernel, tensors in launches:
        seen = set()
        for t in tensors:
            if t.numel() and id(t) in seen:
                twice.append((kernel, tuple(t.shape)))
            seen.add(id(t))
    return twice


@pytest.mark.parametrize("n, cosine, masked, with_bias", [(49, False, False, True), (144, True, True, True),
                                                          (144, False, False, False)],
                         ids=["one-tile-v1", "streamed-cosine-mask", "streamed-no-bias"])
def test_traced_launches_pass_each_input_once(n, cosine, masked, with_bias, monkeypatch):
    """Where torch.compile records the launches, no input stands in for the pointers a
    kernel does not read: inductor prepares each tensor argument on its own and copied a
    computed qkv (GCViT's, a view of a concatenation) once per parameter it filled, six
    times at the forward (compiled GCViT-tiny's inference peak 1.93x timm's). The results
    are the reference's all the same."""
    launches = _record_traced_launches(monkeypatch)
    case = make_case(4, 2, 3, n, 16, cosine=cosine, masked=masked, dtype=torch.float32, device=KERNEL_DEVICE,
                     with_bias=with_bias)
    results = forward_backward(window_attention, case)
    assert {"window_attention_fwd_kernel"} < {kernel for kernel, _ in launches}
    assert _tensors_passed_twice(launches) == []
    assert_matches_reference(results, reference_forward_backward(case), 2e-5)


def test_traced_local_attention_launches_pass_each_input_once(monkeypatch):
    """The same for the local-attention kernels: q does not stand in for the seed."""
    from timm_flashwin import sliding_window_attention
    launches = _record_traced_launches(monkeypatch)
    q, k, v = (torch.randn(1, 2, 40, 16, device=KERNEL_DEVICE, requires_grad=True) for _ in range(3))
    sliding_window_attention(q, k, v, window=(8, 0)).sum().backward()
    assert len(launches) == 3 and _tensors_passed_twice(launches) == []
