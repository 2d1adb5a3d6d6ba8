"""The op against the float64 reference: forward and every gradient, on the grid of
window sizes, head dims and dtypes, and on each kernel path (multi-block dq and bias
gradients, region loops, flat and nested loops, many windows per program, strided qkv).

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter on CPU tensors (set up by conftest.py). The mask and bias handling, the
operator's dispatch, edge cases and bad input, and the GPU-only cases are in the
test_op_*.py files beside this one.
"""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, KERNEL_DEVICE
from opcases import (TOLERANCE, assert_matches_reference, forward_backward, kernels_launched, make_case,
                     reference_forward_backward, relative_error)
from timm_flashwin import window_attention
from timm_flashwin.kernels.window import config
from timm_flashwin.kernels.window.bias_mask import mask_structure
from timm_flashwin.kernels.window.call import DENSE_BIAS
from timm_flashwin.kernels.window.plan import backward_plan
from timm_flashwin.ops.reference import window_attention_reference
from window_calls import window_call

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, head_dim) from the grid; N=42 is a 6x7 window, 144 runs the multi-block path.
TOKENS = [1, 9, 16, 42, 49, 64, 144]
# Under the interpreter head_dim 32 (timm's Swin models') and 48 (padded to a block of 64;
# at N=144 the nested loops): 16 takes every configuration 32 takes (config.py: block_d <=
# 32 throughout), one path twice at 4 to 17 s a case on CI's CPUs. The GPU runs all three.
HEAD_DIMS = [16, 32, 48] if HAS_CUDA else [32, 48]


def test_kernels_are_what_runs():
    """The op's calls in these tests run the attention kernels (on the GPU, or in Triton's
    interpreter on the CPU), not PyTorch's math: every result below is the kernels'."""
    case = make_case(2, 1, 2, 4, 8, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    with kernels_launched() as launched:
        forward_backward(window_attention, case)
    assert launched == ["window_attention_fwd_kernel", "window_attention_bwd_fused_kernel"]


@triton.jit
def _to_bfloat16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n).to(tl.bfloat16), mask=offsets < n)


def test_kernels_round_to_bfloat16_as_torch_does():
    """float32 -> bfloat16 in a kernel (the kernels' P before the P V product, every bf16
    output and gradient they store) rounds as torch does: to nearest, ties to even, with
    infinities, overflow, subnormals and signed zeros bit for bit, and NaN to NaN (the GPU's
    canonical NaN is 0x7fff, torch's CPU conversion writes another payload). On the GPU that
    is cvt.rn (checked on an H100); under the interpreter it is conftest's patch (triton's
    interpreter truncates: 0.99999994 gave 0.99609375)."""
    values = torch.tensor([0.99999994, 1.00390625, 1.01171875, -0.99999994, 1.0 + 2.0 ** -9, 3.4e38, -3.4e38,
                           float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 7.0e-3, -123.456])
    x = values.to(KERNEL_DEVICE)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    _to_bfloat16_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = values.to(torch.bfloat16)
    got = out.cpu()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), expected[~expected.isnan()].view(torch.int16))


# The grid, less (under the interpreter only) float16 at N=144 with head_dim 48: the
# multi-block kernels take 6 s a case on CI's CPUs, and float16's are bfloat16's.
REFERENCE_GRID = [
    pytest.param(cosine, masked, n, head_dim, dtype, id="-".join(
        ("cosine" if cosine else "v1", "mask" if masked else "nomask", str(n), str(head_dim), str(dtype)[6:])))
    for cosine in (False, True) for masked in (False, True) for n in TOKENS for head_dim in HEAD_DIMS
    for dtype in DTYPES if HAS_CUDA or not (n == 144 and dtype == torch.float16 and head_dim != 32)]


@pytest.mark.parametrize("cosine, masked, n, head_dim, dtype", REFERENCE_GRID)
def test_matches_float64_reference(cosine, masked, n, head_dim, dtype):
    # nW = 2 windows per image, B_ = 2 * nW; 3 heads, whose logit scales sit below, above
    # and at the clamp (see opcases.LOGIT_SCALES). Under the interpreter N=144 takes one
    # image (B_ = nW, half the time; window b % nW past the first image is
    # test_multi_block_dq_paths_match_reference's and the other multi-block tests').
    multi_block_on_cpu = n == 144 and not HAS_CUDA
    case = make_case(2 if multi_block_on_cpu else 4, 2, 3, n, head_dim, cosine=cosine, masked=masked, dtype=dtype,
                     device=KERNEL_DEVICE, seed=n * 1000 + head_dim)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[dtype])


# Output gradients in the layouts autograd hands back: a sum's (every stride 0), the
# gradient of a transpose, a broadcast over tokens. (A published window-attention kernel
# read its output's gradient as if contiguous and returned uncorrelated gradients for
# the transposed one: benchmarks/RESULTS.md, the published kernels on an H100.)
GRADIENT_LAYOUTS = {
    "sum": lambda grad: grad.sum().expand_as(grad),
    "transposed": lambda grad: grad.transpose(0, 1).contiguous().transpose(0, 1),
    "broadcast_tokens": lambda grad: grad[:, :1].expand_as(grad),
}


@pytest.mark.parametrize("layout", list(GRADIENT_LAYOUTS))
@pytest.mark.parametrize("n", [16, 144], ids=["one_tile", "multi_block"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_output_gradient_of_any_layout(cosine, n, layout):
    case = make_case(4, 2, 2, n, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    grad_out = GRADIENT_LAYOUTS[layout](case.grad_out)
    assert not grad_out.is_contiguous()
    case = replace(case, grad_out=grad_out)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float32])


@pytest.mark.parametrize("dq_atomic", [True, False], ids=["dq-atomic-adds", "dq-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_multi_block_dq_paths_match_reference(cosine, dtype, dq_atomic, monkeypatch):
    """Both ways of the multi-block backward to dQ (and to the cosine scale gradient): atomic
    adds in the dkdv kernel, or a dq kernel of its own; each (N, D, dtype, kind) takes one
    of them by default (config.backward_config), forced here."""
    key = ("bwd", 144, 32, dtype, cosine)
    monkeypatch.setitem(config.OVERRIDES, key, config.with_changes(config.backward_config(*key[1:]),
                                                                   dq_atomic=dq_atomic))
    assert backward_plan(window_call(144, 32, dtype, cosine, windows=4, heads=3), True, True).dq_atomic == dq_atomic
    case = make_case(4, 2, 3, 144, 32, cosine=cosine, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=7)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[dtype])


@pytest.mark.parametrize("slots", [1, 3], ids=["one-slot", "three-slots"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_multi_block_bias_gradient_by_atomic_adds_matches_reference(cosine, slots, monkeypatch):
    """The bias gradient added up by the dkdv kernel into ``slots`` (H, N, N) slots with atomic
    adds (LaunchConfig.dbias_slots) rather than by the dbias kernel: 4 windows, so that
    windows share a slot. With dQ by atomic adds too, as the default V1 configuration has it."""
    key = ("bwd", 144, 32, torch.float32, cosine)
    tiles = config.with_changes(config.backward_config(*key[1:]), dbias_slots=slots, dq_atomic=True)
    monkeypatch.setitem(config.OVERRIDES, key, tiles)
    call = window_call(144, 32, torch.float32, cosine, windows=4, heads=3, bias=DENSE_BIAS)
    assert backward_plan(call, True, True).slots == slots
    case = make_case(4, 2, 3, 144, 32, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE, seed=9)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float32])


@pytest.mark.parametrize("one_region_loop", [True, False], ids=["one-region-loop", "one-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_one_region_loop_matches_reference(cosine, dtype, one_region_loop, monkeypatch):
    """The kernels that stream key blocks, with and without the loop copy that runs the
    windows of one region without the mask (LaunchConfig.one_region_loop), forward and
    dkdv kernel; the case's mask has windows of one region and windows of three
    (opcases.shift_mask), each config takes one or the other by default, forced here.
    bfloat16 inputs read the mask's region ids too where the float16 copy of bias + mask
    would be too large (config.FOLDED_MASK_MAX_BYTES, set to 0 here)."""
    monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    for pass_, default in (("fwd", config.forward_config), ("bwd", config.backward_config)):
        key = (pass_, 144, 32, dtype, cosine)
        monkeypatch.setitem(config.OVERRIDES, key, config.with_changes(default(*key[1:]),
                                                                       one_region_loop=one_region_loop))
    case = make_case(6, 3, 3, 144, 32, cosine=cosine, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=11)
    info = mask_structure(case.mask)[1]
    assert info[:2].tolist() == [1.0, -100.0] and info[2:].tolist() == [0.0, 1.0, 0.0]
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[dtype])


@pytest.mark.parametrize("flat_loop", [True, False], ids=["flat-loop", "nested-loops"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_flat_and_nested_loops_match_reference(cosine, flat_loop, monkeypatch):
    """The two loop structures of the forward and the dkdv kernel (LaunchConfig.flat_loop):
    one loop over (window, block) steps, programs taking two windows here, or a loop over
    blocks per window. Both match the reference, forward and backward, and a NaN in one
    window stays in that window, as in the reference: a NaN key makes its head's output
    NaN, a NaN output gradient its head's dK, its row's dQ and its channel's dV (the flat loops start
    each window's sums afresh with selects, not products with 0)."""
    for pass_, default in (("fwd", config.forward_config), ("bwd", config.backward_config)):
        key = (pass_, 144, 32, torch.float32, cosine)
        monkeypatch.setitem(config.OVERRIDES, key, config.with_changes(default(*key[1:]), flat_loop=flat_loop))
    case = make_case(6, 3, 3, 144, 32, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE, seed=12)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float32])
    # window 0, token 5, head 0; window 3 shares window 0's programs
    qkv = case.qkv.clone()
    qkv[0, 5, 3 * 32 + 7] = float("nan")  # a key
    out = window_attention(qkv, 3, **case.kwargs())
    expected = window_attention_reference(qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert out[0, :, :32].isnan().all() and out.isnan().sum() == 144 * 32
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5, equal_nan=True)
    grad_out = case.grad_out.clone()
    grad_out[0, 5, 7] = float("nan")
    qkv = case.qkv.clone().requires_grad_()
    window_attention(qkv, 3, **case.kwargs()).backward(grad_out)
    expected = case.qkv.double().requires_grad_()
    window_attention_reference(expected, 3, **case.kwargs(mask=case.mask.double())).backward(grad_out.double())
    dq, dk, dv = qkv.grad[0].view(144, 3, 3, 32)[:, :, 0].unbind(1)
    assert dk.isnan().all() and dq[5].isnan().all() and dv[:, 7].isnan().all() and not qkv.grad[1:].isnan().any()
    assert torch.equal(qkv.grad.isnan(), expected.grad.isnan())
    finite = ~expected.grad.isnan()
    assert relative_error(qkv.grad[finite], expected.grad[finite]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("numel, heads", [(1, 3), (777, 20), (3 * 144 * 144 + 5, 3)])
def test_delta_kernel_zeroes_the_gradient_sums(numel, heads):
    """The delta kernel zeroes the buffers the atomic adds of the bias gradient and of the
    (H,) logit-scale gradient go into, every element whatever their sizes against the
    kernel's programs (fewer elements than programs, not a multiple of them, many per
    program; more than 16 heads), and computes rowsum(dO * O)."""
    from timm_flashwin.kernels.window.backward_dkdv import window_attention_bwd_delta_kernel
    windows, n, head_dim, block = 2, 144, 32, 64
    g = torch.Generator().manual_seed(0)
    out = torch.randn(windows, n, heads * head_dim, generator=g).to(KERNEL_DEVICE)
    dout = torch.randn(windows, n, heads * head_dim, generator=g).to(KERNEL_DEVICE)
    delta = torch.empty(windows, heads, n, device=KERNEL_DEVICE)
    sums = torch.full((numel,), float("nan"), device=KERNEL_DEVICE)
    scale_sums = torch.full((heads + 1,), float("nan"), device=KERNEL_DEVICE)
    programs = windows * heads * -(-n // block)
    window_attention_bwd_delta_kernel[(programs,)](
        out, dout, delta, sums, sums, numel, -(-numel // programs), scale_sums, *out.stride(), *dout.stride(),
        H=heads, N=n, D=head_dim, BLOCK_M=block, BLOCK_D=head_dim, DQ_ATOMIC=False, ZERO_SUMS=True,
        ZERO_SCALE_SUMS=True)
    assert (sums == 0).all() and (scale_sums[:heads] == 0).all() and scale_sums[heads].isnan()
    expected = (out * dout).view(windows, n, heads, head_dim).sum(-1).transpose(1, 2)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)


def test_deterministic_mode_takes_the_dq_kernel(deterministic_algorithms, monkeypatch):
    """Under torch.use_deterministic_algorithms(True), no atomic adds: a multi-block
    backward configured to add dQ and the bias gradient up with them runs its dq and dbias
    kernels instead, and the dbias kernel writes partials rather than adding its sums."""
    tiles = config.with_changes(config.backward_config(144, 32, torch.bfloat16, False), dbias_slots=4)
    monkeypatch.setitem(config.OVERRIDES, ("bwd", 144, 32, torch.bfloat16, False), tiles)
    plan = backward_plan(window_call(144, 32, torch.bfloat16, False, windows=4, heads=3, bias=DENSE_BIAS), True, False)
    assert tiles.dq_atomic and not plan.dq_atomic and plan.slots == 0
    assert not plan.atomic_sum  # the dbias kernel writes partials
    case = make_case(4, 2, 3, 144, 32, cosine=False, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE, seed=8)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("n", [42, 144])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_head_dim_not_a_multiple_of_8(cosine, n):
    """head_dim 44 is swinv2_cr_huge's (352 channels / 8 heads): rows are not 16-byte
    aligned and the head dim is padded to a block of 64. One tile and multi-block, fp16."""
    case = make_case(4, 2, 3, n, 44, cosine=cosine, masked=True, dtype=torch.float16, device=KERNEL_DEVICE,
                     seed=n * 1000 + 44)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float16])

@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_parameters_in_input_dtype(cosine):
    """model.half(): bias and logit scale in the activations' dtype."""
    case = make_case(4, 2, 3, 49, 32, cosine=cosine, masked=True, dtype=torch.float16, device=KERNEL_DEVICE,
                     param_dtype=torch.float16)
    results = forward_backward(window_attention, case)
    assert [r.dtype for r in results[2:]] == [torch.float16] * len(results[2:])
    assert_matches_reference(results, reference_forward_backward(case), TOLERANCE[torch.float16])


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_no_bias(cosine):
    case = make_case(4, 2, 3, 49, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE,
                     with_bias=False)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case), 1e-4,
                             names=("out", "d_qkv", "d_logit_scale"))


def test_many_windows_per_program():
    """More windows than programs: each program loops over several windows and sums
    the bias gradient over them."""
    case = make_case(48, 4, 2, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case), 1e-4)


@pytest.mark.parametrize("windows", [1, 5, 6, 7, 64, 1000])
@pytest.mark.parametrize("parallel", [1, 48, 5000])
def test_split_windows_puts_every_window_in_one_chunk(windows, parallel):
    chunks, per_chunk = config.split_windows(windows, parallel, 1056)
    assert (chunks - 1) * per_chunk < windows <= chunks * per_chunk  # no chunk empty, none missing
    assert per_chunk >= min(config.MIN_WINDOWS_PER_PROGRAM, windows)


def test_strided_qkv_is_read_without_copy():
    """qkv as a view with padded token and channel strides gives the same result."""
    case = make_case(4, 2, 3, 49, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    wide = torch.zeros(4, 49 * 2, case.qkv.shape[-1] + 8, device=KERNEL_DEVICE)
    view = wide[:, ::2, 4:-4]
    view.copy_(case.qkv)
    assert not view.is_contiguous()
    out = window_attention(view, 3, **case.kwargs())
    torch.testing.assert_close(out, window_attention(case.qkv, 3, **case.kwargs()), rtol=0, atol=0)
