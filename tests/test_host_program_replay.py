"""Host programs on a GPU: replayed calls of both operators against the Python road that
recorded them (to the bit where the kernels add no atomics), the backward with any
gradient layout, signatures recorded by a later call, calls without gradient, aliased
inputs."""
import pytest
import torch

from conftest import HAS_CUDA
from host_program_cases import CASES, case_call, ready_programs, shift_mask
from test_position_bias import relative_position_index
from timm_flashwin import TableBias, sliding_window_attention, window_attention
from timm_flashwin.ops import host_program, native

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@cuda
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("qkv_grad", [True, False], ids=["qkv_grad", "table_grad_only"])
def test_replayed_calls_match_the_python_road(case, qkv_grad):
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    run = case_call(case, qkv_grad)
    ready = ready_programs()
    recorded = run()  # the Python road, recorded: forward, then backward
    replayed = [run(), run()]
    one_tile = case[1] * case[1] <= 64
    # one-tile windows replay, and so do windows of several key blocks: the float16 bias
    # copy the forward keeps on the bias (a table the op gathers, a dense bias made in the
    # call) is saved for the backward, which then knows it (the CPU's recordings see no
    # launch, hence not this: the backward's recording failed on it)
    assert ready_programs() == ready + 1
    for result in replayed:
        for got, want in zip(result, recorded):
            # one-tile kernels add no atomics: the same launches give the same bits
            torch.testing.assert_close(got, want, **(dict(rtol=0, atol=0) if one_tile else {}))


@cuda
@needs_cuda
def test_replayed_backward_takes_any_gradient_layout():
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    qkv = torch.randn(8, 49, 3 * 3 * 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    table = torch.randn(169, 3, device="cuda", requires_grad=True)
    bias = TableBias(table, relative_position_index(7, 7).cuda(), constant_index=True)
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
def test_local_backward_recorded_with_its_output_in_q_layout():
    """q, k, v as (B, S, H, D) tensors seen as (B, H, S, D): the output keeps that layout and
    out.transpose(1, 2).reshape(B, S, H * D) gives its gradient back in it, not contiguous
    (Hiera's pooling blocks): the backward is recorded with those strides and replays; a
    gradient in another layout is copied into them (the same bits)."""
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    B, S, H, D = 2, 300, 4, 64
    bases = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    grad = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)

    def run(grad_out, merged=True):
        out = sliding_window_attention(*(b.transpose(1, 2) for b in bases), window=(64, 64))
        out = out.transpose(1, 2).reshape(B, S, H * D) if merged else out
        return torch.autograd.grad(out, bases, grad_out), out.grad_fn.name()

    ready = ready_programs()
    want, _ = run(grad)  # recorded
    assert ready_programs() == ready + 1
    replayed, _ = run(grad)
    contiguous, node = run(grad.view(B, S, H, D).transpose(1, 2).contiguous(), merged=False)
    assert "HostProgramFunction" in node
    for result in (replayed, contiguous):
        for got, expected in zip(result, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@cuda
@needs_cuda
def test_a_signature_whose_first_graph_is_dropped_is_recorded_by_a_later_call():
    """The first call's forward is recorded but its graph dropped unused (no backward):
    a later call of the signature records the backward, and the calls after it replay."""
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    qkv = torch.randn(8, 49, 3 * 5 * 16, device="cuda", dtype=torch.float16, requires_grad=True)
    table = torch.randn(169, 5, device="cuda", requires_grad=True)
    bias = TableBias(table, relative_position_index(7, 7).cuda(), constant_index=True)
    ready = ready_programs()
    window_attention(qkv, 5, bias=bias, scale=0.25)  # forward recorded, graph dropped
    assert ready_programs() == ready
    out = window_attention(qkv, 5, bias=bias, scale=0.25)
    want = torch.autograd.grad(out, (qkv, table), torch.ones_like(out))
    assert ready_programs() == ready + 1
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
    ready = ready_programs()
    _, recorded = run()
    assert ready_programs() == ready + 1
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
    bias = TableBias(table, relative_position_index(7, 7).cuda(), constant_index=True)
    mask = shift_mask(4, 49).cuda()
    q, k, v = (torch.randn(1, 4, 333 + size, 64, generator=generator).to("cuda", torch.float16) for _ in range(3))
    calls = [lambda: window_attention(qkv, 3, bias=bias, mask=mask, scale=0.17),
             lambda: sliding_window_attention(q, k, v, window=(50, 7))]
    for op_call in calls:
        with host_program.switched_off(), context():
            want = op_call()
        ready = ready_programs()
        with context():
            outs = [op_call() for _ in range(3)]  # recorded, then replayed twice
        assert ready_programs() == ready + 1
        with torch.no_grad():
            outs.append(op_call())
        assert not outs[-1].is_inference()
        for got in outs:
            assert got.grad_fn is None
            torch.testing.assert_close(got, want, rtol=0, atol=0)


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


@cuda
@needs_cuda
def test_a_setting_changed_after_a_shape_was_recorded_is_followed(monkeypatch):
    """A call's key holds every setting its plans read: once its shape is recorded and
    replayed, ``config.FOLDED_MASK_MAX_BYTES`` set to 0 makes the next call of that shape
    another key, run (and recorded) on the Python road, whose launches read the mask apart
    (its region ids) instead of folded into the float16 bias copy; it gives that road's bits,
    and so does its replay."""
    if native.module() is None:
        pytest.skip("the host-program extension cannot be built here")
    from timm_flashwin.kernels.window import config, launch
    from timm_flashwin.kernels import launcher as launcher_module
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(8, 144, 3 * 3 * 16, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    bias = torch.randn(3, 144, 144, generator=generator).to("cuda").requires_grad_()
    mask = shift_mask(4, 144).to("cuda")

    def run():
        out = window_attention(qkv, 3, bias=bias, mask=mask, scale=0.25)
        return [out.detach(), *torch.autograd.grad(out, (qkv, bias), torch.ones_like(out))]
    launches, real = [], launcher_module.launcher

    def recording(kernel):
        launch_of = real(kernel)

        class Recorded:
            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    launches.append((kernel.__name__, kwargs.get("HAS_MASK"), kwargs.get("MASK_REGIONS")))
                    return launch_of[grid](*args, **kwargs)
                return go
        return Recorded()
    monkeypatch.setattr(launch, "launcher", recording)
    ready = ready_programs()
    run()
    run()  # recorded, then replayed
    assert ready_programs() == ready + 1
    launches.clear()
    run()
    assert not launches  # replayed from C++
    monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    apart = run()
    forward = [flags for flags in launches if flags[0] == "window_attention_fwd_kernel"]
    assert forward and all(has_mask and regions for _, has_mask, regions in forward)
    assert ready_programs() == ready + 2
    with host_program.switched_off():
        python_road = run()
    for got, want in zip(apart, python_road):
        torch.testing.assert_close(got, want)
    for got, want in zip(run(), apart):  # the new key's replay
        torch.testing.assert_close(got, want)
