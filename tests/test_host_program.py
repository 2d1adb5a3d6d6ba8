"""Host programs (timm_flashwin/host_program.py): the recorder on CPU; on a GPU, replayed
calls against the Python road that recorded them, to the bit."""
import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from timm_flashwin import TableBias, WindowGrid, host_program, native, window_attention
from timm_flashwin.host_program import Recorder
from timm_flashwin.position_bias import TableGather

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
    from timm_flashwin import host_program as hp
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


@pytest.mark.parametrize("op", ["window", "window_gathered_table", "local"])
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
    it)."""
    from timm_flashwin import local_attention, op as window_op
    if HAS_CUDA and native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(KERNEL_DEVICE).requires_grad_()  # noqa: E731
    if op == "window":
        qkv, bias = randn(4, 9, 3 * 2 * 8), randn(2, 9, 9)
        inputs = (qkv, 2, bias, None, None, 0.3, False, 0.0, None, True)
        tensors = [qkv, bias]
        road = lambda: window_op._EagerWindowAttention.apply(*inputs, None, None)[0]  # noqa: E731
        forward_alone = lambda: window_op._forward_without_grad(*inputs[:-1], False, None, None)[0]  # noqa: E731
    elif op == "window_gathered_table":
        qkv = torch.randn(2, 144, 3 * 2 * 16, generator=generator).to(KERNEL_DEVICE, torch.bfloat16).requires_grad_()
        table = randn(23 * 23, 2)
        table_gather = TableGather.of(TableBias(table, _relative_index(12).to(KERNEL_DEVICE)), False)
        inputs = (qkv, 2, table, None, None, 0.25, False, 0.0, None, True)
        tensors = [qkv, table, *window_op._host_tensors(table_gather)]
        road = lambda: window_op._EagerWindowAttention.apply(*inputs, None, table_gather)[0]  # noqa: E731
        forward_alone = lambda: window_op._forward_without_grad(*inputs[:-1], False, None, table_gather)[0]  # noqa: E731
    else:
        q, k, v = (randn(1, 2, 20, 16) for _ in range(3))
        tensors = [q, k, v]
        inputs = (q, k, v, 1, 8, 1, 0, 0.25, 0.0, None)
        road = lambda: local_attention._EagerLocalAttention.apply(*inputs)[0]  # noqa: E731
        forward_alone = lambda: local_attention._forward_without_grad(*inputs)  # noqa: E731
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


def _relative_index(window: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def _shift_mask(windows: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.where(torch.rand(windows, n, n, generator=generator) < 0.3, -100.0, 0.0)


#: (name, window, heads, head_dim, dtype, bias kind, mask, grid, dropout)
CASES = [
    ("v1_table_mask", 7, 3, 32, torch.bfloat16, "table", True, False, 0.0),
    ("v1_dense_bias", 7, 4, 16, torch.float16, "dense", True, False, 0.0),
    ("cosine_sigmoid_table", 8, 4, 32, torch.float16, "sigmoid", False, False, 0.0),
    ("v1_feature_map", 7, 3, 32, torch.bfloat16, "table", True, True, 0.0),
    ("v1_dropout", 7, 3, 32, torch.bfloat16, "table", False, False, 0.1),
    ("v1_window12", 12, 4, 32, torch.bfloat16, "table", True, False, 0.0),
    ("cosine_sigmoid_window12", 12, 4, 32, torch.bfloat16, "sigmoid", True, False, 0.0),
    # float32: the kernels read the mask's region ids, kept on the mask, the programs' inputs
    ("v1_window12_float32", 12, 4, 32, torch.float32, "table", True, False, 0.0),
    # a dense bias made anew each call (SwinV2-CR's meta-MLP bias), no mask: windows of
    # several key blocks that record to the end (their float16 bias copy made in the call)
    ("dense_window12_no_mask", 12, 4, 32, torch.bfloat16, "dense", False, False, 0.0),
]


def _call(case, qkv_grad: bool = True):
    name, window, heads, head_dim, dtype, bias_kind, with_mask, with_grid, dropout = case
    n, images = window * window, 2 if HAS_CUDA else 1  # the CPU: half the interpreter time
    grid = WindowGrid(2 * window, 2 * window, (window, window), (window // 2,) * 2) if with_grid else None
    windows = images * (grid.num_windows if grid else 4)
    generator = torch.Generator().manual_seed(0)
    if grid:
        qkv = torch.randn(images, grid.height * grid.width, 3 * heads * head_dim, generator=generator)
    else:
        qkv = torch.randn(windows, n, 3 * heads * head_dim, generator=generator)
    qkv = qkv.to(KERNEL_DEVICE, dtype).requires_grad_(qkv_grad)
    table = torch.randn((2 * window - 1) ** 2, heads, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    index = _relative_index(window).to(KERNEL_DEVICE)
    leaves = [t for t in (qkv, table) if t.requires_grad]
    kwargs = dict(scale=head_dim ** -0.5)
    if bias_kind == "sigmoid":
        logit_scale = torch.full((heads, 1, 1), 2.3, device=KERNEL_DEVICE, requires_grad=True)
        kwargs = dict(logit_scale=logit_scale)
        leaves.append(logit_scale)
    table_bias = TableBias(table, index, 16.0 if bias_kind == "sigmoid" else None, constant_index=True)
    mask = _shift_mask(4 if not grid else grid.num_windows, n).to(KERNEL_DEVICE) if with_mask else None
    out_shape = (*qkv.shape[:2], heads * head_dim)
    grad_out = torch.randn(out_shape, generator=generator).to(KERNEL_DEVICE, dtype)

    def run():
        torch.manual_seed(3)  # the dropout seed
        bias = table_bias if bias_kind != "dense" else table[index.view(-1)].view(n, n, heads).permute(2, 0, 1)
        out = window_attention(qkv, heads, bias=bias, mask=mask, dropout_p=dropout, grid=grid, **kwargs)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    return run


def _ready() -> int:
    return sum(s.index is not None for s in host_program._SIGNATURES.values())


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
    _call(case)()
    assert cpu_recordings() == ["no launch, or launches on two devices"]


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the replay tests hold this")
def test_a_mask_kept_by_one_signature_serves_the_next_one_on_the_cpu(cpu_recordings):
    """Where the kernels read a mask's region ids (float32, windows over 64 tokens), they are
    kept on the mask and taken by the host programs as inputs: a second signature of the same
    mask (another batch size, a call without gradient) records too. It did not (a value kept
    by an earlier call), and the first stopped at the ids' ``torch.cat``."""
    generator = torch.Generator().manual_seed(0)
    mask = _shift_mask(4, 144).to(KERNEL_DEVICE)
    table = torch.randn(23 * 23, 1, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    bias = TableBias(table, _relative_index(12).to(KERNEL_DEVICE), constant_index=True)
    for windows in (4, 8):
        qkv = torch.randn(windows, 144, 3 * 16, generator=generator).to(KERNEL_DEVICE).requires_grad_()
        window_attention(qkv, 1, bias=bias, mask=mask, scale=0.25).sum().backward()
        with torch.no_grad():
            window_attention(qkv, 1, bias=bias, mask=mask, scale=0.25)
    assert cpu_recordings() == ["no launch"] * 2 + ["no launch, or launches on two devices"] * 2


@cuda
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("qkv_grad", [True, False], ids=["qkv_grad", "table_grad_only"])
def test_replayed_calls_match_the_python_road(case, qkv_grad):
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    run = _call(case, qkv_grad)
    ready = _ready()
    recorded = run()  # the Python road, recorded: forward, then backward
    replayed = [run(), run()]
    one_tile = case[1] * case[1] <= 64
    # one-tile windows replay, and so do windows of several key blocks: the float16 bias
    # copy the forward keeps on the bias (a table the op gathers, a dense bias made in the
    # call) is saved for the backward, which then knows it (the CPU's recordings see no
    # launch, hence not this: the backward's recording failed on it)
    assert _ready() == ready + 1
    for result in replayed:
        for got, want in zip(result, recorded):
            # one-tile kernels add no atomics: the same launches give the same bits
            torch.testing.assert_close(got, want, **(dict(rtol=0, atol=0) if one_tile else {}))


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


@cuda
@needs_cuda
def test_replayed_backward_takes_any_gradient_layout():
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    qkv = torch.randn(8, 49, 3 * 3 * 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    table = torch.randn(169, 3, device="cuda", requires_grad=True)
    bias = TableBias(table, _relative_index(7).cuda(), constant_index=True)
    grad = torch.randn(49, 8, 96, device="cuda", dtype=torch.bfloat16).transpose(0, 1)  # not dense

    def run(grad_out):
        out = window_attention(qkv, 3, bias=bias, scale=0.17)
        return torch.autograd.grad(out, (qkv, table), grad_out)
    run(grad.contiguous())  # recorded with a dense gradient
    want = run(grad.contiguous())
    for got, expected in zip(run(grad), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not differentiable"):
        out = window_attention(qkv, 3, bias=bias, scale=0.17)
        torch.autograd.grad(out, qkv, grad.contiguous(), create_graph=True)


@cuda
@needs_cuda
def test_a_signature_whose_first_graph_is_dropped_is_recorded_by_a_later_call():
    """The first call's forward is recorded but its graph dropped unused (no backward):
    a later call of the signature records the backward, and the calls after it replay."""
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    qkv = torch.randn(8, 49, 3 * 5 * 16, device="cuda", dtype=torch.float16, requires_grad=True)
    table = torch.randn(169, 5, device="cuda", requires_grad=True)
    bias = TableBias(table, _relative_index(7).cuda(), constant_index=True)
    ready = _ready()
    window_attention(qkv, 5, bias=bias, scale=0.25)  # forward recorded, graph dropped
    assert _ready() == ready
    out = window_attention(qkv, 5, bias=bias, scale=0.25)
    want = torch.autograd.grad(out, (qkv, table), torch.ones_like(out))
    assert _ready() == ready + 1
    out = window_attention(qkv, 5, bias=bias, scale=0.25)
    assert "HostProgramFunction" in out.grad_fn.name()
    for got, expected in zip(torch.autograd.grad(out, (qkv, table), torch.ones_like(out)), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


#: (name, function, its keyword arguments, heads, key/value heads, S, D, dtype, which inputs take a gradient)
LOCAL_CASES = [
    ("causal_window_gqa", "sliding", dict(window=(100, 0)), 8, 2, 300, 64, torch.bfloat16, "qkv"),
    ("global_fp16", "sliding", dict(window=(None, None)), 4, 4, 129, 32, torch.float16, "qkv"),
    ("frames_sink_dropout", "blocks", dict(block_size=32, window_blocks=3, sink_tokens=5, dropout_p=0.1), 4, 1, 200,
     64, torch.bfloat16, "qkv"),
    ("queries_only_fp32", "sliding", dict(window=(16, 16)), 2, 2, 96, 40, torch.float32, "q"),
]


@cuda
@needs_cuda
@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_replayed_local_attention_matches_the_python_road(case):
    """The local-attention operators' eager calls replay as host programs too: output and
    gradients equal the recorded Python road's, bit for bit (no atomics in their kernels)."""
    from timm_flashwin import block_sliding_window_attention, sliding_window_attention
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    _, function, kwargs, heads, kv_heads, seq_len, head_dim, dtype, grads = case
    attend = sliding_window_attention if function == "sliding" else block_sliding_window_attention
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq_len, head_dim, generator=generator).to("cuda", dtype)
               for h in (heads, kv_heads, kv_heads))
    leaves = [t.requires_grad_() for t, name in zip((q, k, v), "qkv") if name in grads]
    grad_out = torch.randn(q.shape, generator=generator).to("cuda", dtype)

    def run():
        torch.manual_seed(3)  # the dropout seed
        out = attend(q, k, v, **kwargs)
        return out, (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    ready = _ready()
    _, recorded = run()
    assert _ready() == ready + 1
    for _ in range(2):
        out, replayed = run()
        assert "HostProgramFunction" in out.grad_fn.name()
        for got, want in zip(replayed, recorded):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_calls_without_grad_replay_the_forward_alone(mode):
    """Where nothing takes a gradient both operators replay their forward without an autograd
    node; the outputs equal the Python road's, bit for bit, and under no_grad are not
    inference tensors (a replay recorded under inference mode serves no_grad calls too)."""
    from timm_flashwin import sliding_window_attention
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    generator = torch.Generator().manual_seed(0)
    size = 0 if mode == "no_grad" else 1  # a signature of each mode's own
    qkv = torch.randn(8 + 4 * size, 49, 3 * 3 * 32, generator=generator).to("cuda", torch.bfloat16)
    table = torch.randn(169, 3, generator=generator).cuda()
    bias = TableBias(table, _relative_index(7).cuda(), constant_index=True)
    mask = _shift_mask(4, 49).cuda()
    q, k, v = (torch.randn(1, 4, 333 + size, 64, generator=generator).to("cuda", torch.float16) for _ in range(3))
    calls = [lambda: window_attention(qkv, 3, bias=bias, mask=mask, scale=0.17),
             lambda: sliding_window_attention(q, k, v, window=(50, 7))]
    for op_call in calls:
        with host_program.switched_off(), context():
            want = op_call()
        ready = _ready()
        with context():
            outs = [op_call() for _ in range(3)]  # recorded, then replayed twice
        assert _ready() == ready + 1
        with torch.no_grad():
            outs.append(op_call())
        assert not outs[-1].is_inference()
        for got in outs:
            assert got.grad_fn is None
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_tensor_passed_for_several_inputs_keys_a_signature_of_its_own():
    """attend(x, x, x): the recorder maps one tensor to one slot, so a program recorded from
    such a call must serve only calls that alias the same inputs."""
    x, y, z = torch.randn(2), torch.randn(2), torch.randn(2)
    key = ("k",)
    assert host_program.with_aliases(key, [x, y, z]) == key
    aliased = host_program.with_aliases(key, [x, y, y])
    assert aliased != key and aliased == host_program.with_aliases(key, [z, x, x])
    assert aliased != host_program.with_aliases(key, [x, x, y])


@cuda
@needs_cuda
def test_aliased_and_distinct_inputs_replay_apart():
    """attend(x, x, x) and attend(q, k, v) of the same shapes record programs of their own:
    each replay gives its Python road's result."""
    from timm_flashwin import sliding_window_attention
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    generator = torch.Generator().manual_seed(0)
    x, q, k, v = (torch.randn(1, 2, 150, 32, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
                  for _ in range(4))
    grad_out = torch.randn(1, 2, 150, 32, generator=generator).to("cuda", torch.bfloat16)

    def run(inputs, leaves):
        out = sliding_window_attention(*inputs, window=(20, 3))
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    with host_program.switched_off():
        want_self, want = run((x, x, x), (x,)), run((q, k, v), (q, k, v))
    for _ in range(3):  # recorded, then replayed: self-attention and three tensors alternately
        for got, expected in zip(run((x, x, x), (x,)), want_self):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for got, expected in zip(run((q, k, v), (q, k, v)), want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


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
