"""The op on a GPU only: large shapes, autocast with float32 parameters, no recompilation
for new batches, windows or scales, torch.compile fullgraph, opcheck, a GPU that is not
the current one."""

import pytest
import torch

from opcases import (TOLERANCE, assert_matches_reference, forward_backward, make_case, reference_forward_backward,
                     relative_error)
from timm_flashwin import window_attention
from timm_flashwin.ops.window_operators import window_attention_fwd
from timm_flashwin.ops.reference import window_attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

GPU_SHAPES = [  # (B_, nW, H, N, D)
    (64, 16, 3, 49, 32), (32, 4, 4, 64, 32), (16, 4, 4, 144, 32), (8, 2, 3, 256, 32), (8, 2, 2, 256, 64),
    (4, 2, 2, 576, 32), (2, 1, 2, 1024, 32), (8, 2, 2, 64, 128), (4, 2, 2, 49, 256), (2, 1, 1, 576, 256),
    (8, 2, 3, 100, 24),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_large_shapes(cosine, shape, dtype):
    windows, num_windows, heads, n, head_dim = shape
    case = make_case(windows, num_windows, heads, n, head_dim, cosine=cosine, masked=True, dtype=dtype,
                     device="cuda", seed=n + head_dim)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_autocast_fp32_parameters(cosine, dtype):
    """The qkv linear under autocast gives bf16/fp16 activations; bias and logit scale
    stay float32 parameters, and their gradients come back float32."""
    heads, n, head_dim, dim = 3, 49, 32, 96
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, n, dim, device="cuda", generator=g)
    linear = torch.nn.Linear(dim, 3 * heads * head_dim, device="cuda")
    case = make_case(32, 8, heads, n, head_dim, cosine=cosine, masked=True, dtype=torch.float32, device="cuda")
    bias = case.bias.clone().requires_grad_()
    logit_scale = case.logit_scale.clone().requires_grad_() if cosine else None
    with torch.autocast("cuda", dtype=dtype):
        qkv = linear(x)
        assert qkv.dtype == dtype
        out = window_attention(qkv, heads, bias=bias, mask=case.mask, scale=case.scale, logit_scale=logit_scale)
    out.float().square().mean().backward()
    assert bias.grad.dtype == torch.float32
    qkv_ref = qkv.detach().double().requires_grad_()
    bias_ref = bias.detach().double().requires_grad_()
    ls_ref = logit_scale.detach().double().requires_grad_() if cosine else None
    ref = window_attention_reference(qkv_ref, heads, bias=bias_ref, mask=case.mask.double(), scale=case.scale,
                                     logit_scale=ls_ref)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    ref.float().square().mean().backward()
    assert relative_error(bias.grad, bias_ref.grad) < TOLERANCE[dtype]
    if cosine:
        assert relative_error(logit_scale.grad, ls_ref.grad) < TOLERANCE[dtype]


def _compiled_kernel_count() -> int:
    """Compiled variants of our kernels across Triton versions."""
    from timm_flashwin.kernels.window import backward, forward
    kernels = [forward.window_attention_fwd_kernel, backward.window_attention_bwd_fused_kernel]
    total = 0
    for kernel in kernels:
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            total += sum(len(entry[0]) for entry in caches.values())
        else:
            total += sum(len(c) for c in kernel.cache.values())
    return total


@pytest.mark.cuda
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_no_recompile_for_new_batch_windows_or_scale(cosine):
    def step(windows, num_windows, seed, scale_shift):
        case = make_case(windows, num_windows, 3, 49, 32, cosine=cosine, masked=True, dtype=torch.bfloat16,
                         device="cuda", seed=seed)
        if cosine:
            case.logit_scale = case.logit_scale + scale_shift
        else:
            case.scale = case.scale + scale_shift
        forward_backward(window_attention, case)

    step(64, 16, 0, 0.0)
    torch.cuda.synchronize()
    before = _compiled_kernel_count()
    for windows, num_windows, seed, shift in [(48, 16, 1, 0.1), (17, 17, 2, -0.2), (130, 65, 3, 0.3), (4, 1, 4, 1.0)]:
        step(windows, num_windows, seed, shift)
    torch.cuda.synchronize()
    assert _compiled_kernel_count() == before


@pytest.mark.cuda
@pytest.mark.parametrize("n", [49, 144])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_torch_compile_fullgraph(cosine, n):
    """Inductor with the op inside: one graph, forward and backward match eager."""
    torch._dynamo.reset()
    case = make_case(16, 4, 3, n, 32, cosine=cosine, masked=True, dtype=torch.bfloat16, device="cuda")

    def block(qkv, bias, mask, logit_scale):
        out = window_attention(qkv * 1.5, 3, bias=bias * 2, mask=mask, scale=case.scale, logit_scale=logit_scale)
        return torch.nn.functional.gelu(out)

    compiled = torch.compile(block, fullgraph=True)
    results = []
    for fn in (block, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in case.leaves()]
        logit_scale = leaves[2] if cosine else None
        out = fn(leaves[0], leaves[1], case.mask, logit_scale)
        out.backward(case.grad_out)
        results.append([out] + [t.grad for t in leaves])
    for eager, comp in zip(*results):
        assert relative_error(comp, eager) < 1e-2


@pytest.mark.cuda
def test_gpu_opcheck():
    case = make_case(8, 4, 2, 49, 32, cosine=True, masked=True, dtype=torch.bfloat16, device="cuda")
    logit_scale = case.logit_scale.reshape(2).requires_grad_()
    torch.library.opcheck(window_attention_fwd, (case.qkv.requires_grad_(), 2, case.bias.requires_grad_(),
                                                 case.mask, logit_scale, 1.0, True, 0.0, None))
    seed = torch.tensor([1234], dtype=torch.int64, device="cuda")
    torch.library.opcheck(window_attention_fwd, (case.qkv, 2, case.bias, case.mask, logit_scale, 1.0, True, 0.25, seed))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("n", [49, 144], ids=["one_tile", "multi_block"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_runs_on_a_gpu_that_is_not_the_current_one(cosine, n):
    """Inputs on cuda:1 while cuda:0 is the current device (a model moved with
    ``.to("cuda:1")``): the kernels run on the inputs' GPU, forward, every gradient and the
    bias gather with its table gradient as on cuda:0."""
    from timm_flashwin.ops.position_bias import gather_position_bias
    from test_position_bias import relative_position_index
    case = make_case(16, 4, 3, n, 32, cosine=cosine, masked=True, dtype=torch.bfloat16, device="cuda")
    win = int(n ** 0.5)
    index = relative_position_index(win, win)
    table = torch.randn((2 * win - 1) ** 2, 3, generator=torch.Generator().manual_seed(n))
    results = []
    for device in ("cuda:0", "cuda:1"):
        with torch.cuda.device(0):
            leaves = [t.detach().to(device).requires_grad_() for t in case.leaves()]
            table_here = table.to(device).requires_grad_()
            bias = leaves[1] + gather_position_bias(table_here, index.to(device))
            out = window_attention(leaves[0], 3, bias=bias, mask=case.mask.to(device),
                                   scale=None if cosine else case.scale, logit_scale=leaves[2] if cosine else None)
            out.backward(case.grad_out.to(device))
            torch.cuda.synchronize(device)
            results.append([t.cpu() for t in [out, table_here.grad] + [t.grad for t in leaves]])
    for on_0, on_1 in zip(*results):
        torch.testing.assert_close(on_1, on_0, rtol=1e-2, atol=1e-2)
