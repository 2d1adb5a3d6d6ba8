"""The op against the float64 reference: forward and every gradient.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter on CPU tensors (set up by conftest.py).
"""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, KERNEL_DEVICE
from opcases import (TOLERANCE, assert_matches_reference, bias_as_read, forward_backward, make_case,
                     reference_forward_backward, relative_error, shift_mask)
from timm_flashwin import window_attention
from timm_flashwin.kernels import config
from timm_flashwin.op import uses_kernels, window_attention_fwd
from timm_flashwin.kernels.bias_mask import mask_structure
from timm_flashwin.kernels.plan import dbias_slots, dbias_sum_by_atomic_adds, dq_by_atomic_adds
from timm_flashwin.kernels.tiles import head_scale
from timm_flashwin.reference import LOGIT_SCALE_MAX, window_attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, head_dim) from the grid; N=42 is a 6x7 window, 144 runs the multi-block path.
TOKENS = [1, 9, 16, 42, 49, 64, 144]
# Under the interpreter head_dim 32 (timm's Swin models') and 48 (padded to a block of 64;
# at N=144 the nested loops): 16 takes every configuration 32 takes (config.py: block_d <=
# 32 throughout), one path twice at 4 to 17 s a case on CI's CPUs. The GPU runs all three.
HEAD_DIMS = [16, 32, 48] if HAS_CUDA else [32, 48]


def test_kernels_are_what_runs():
    case = make_case(2, 1, 2, 4, 8, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    assert uses_kernels(case.qkv)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_matches_float64_reference(cosine, masked, n, head_dim, dtype):
    # nW = 2 windows per image, B_ = 2 * nW; 3 heads, whose logit scales sit below, above
    # and at the clamp (see opcases.LOGIT_SCALES).
    case = make_case(4, 2, 3, n, head_dim, cosine=cosine, masked=masked, dtype=dtype, device=KERNEL_DEVICE,
                     seed=n * 1000 + head_dim)
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
    assert dq_by_atomic_adds(config.backward_config(*key[1:])) == dq_atomic
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
    assert dbias_slots(config.backward_config(*key[1:])) == slots
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
    from timm_flashwin.kernels.backward_dkdv import window_attention_bwd_delta_kernel
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
    assert tiles.dq_atomic and not dq_by_atomic_adds(tiles) and dbias_slots(tiles) == 0
    assert not dbias_sum_by_atomic_adds()  # the dbias kernel writes partials
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


def test_mask_structure_recognizes_region_masks_only():
    """The multi-block kernels compute M from region ids only where M is exactly
    value * [region_i != region_j]; any other mask keeps being read densely."""
    shift = shift_mask(3, 16, torch.Generator().manual_seed(0))
    regions, info = mask_structure(shift)
    assert info.tolist() == [1.0, -100.0, 0.0, 1.0, 0.0]  # [exact, value, then window 1 alone one region]
    assert torch.equal(torch.where(regions[:, :, None] == regions[:, None, :], 0.0, -100.0), shift)
    assert mask_structure(torch.where(shift == 0, 0.0, float("-inf")))[1].tolist() == [1.0, float("-inf"), 0, 1, 0]
    assert mask_structure(torch.zeros(2, 9, 9))[1].tolist() == [1.0, 0.0, 1.0, 1.0]
    two_values = shift.clone()
    two_values[0, 0, shift[0, 0] != 0] = -50.0
    nan = shift.clone()
    nan[2, 3, 4] = float("nan")
    no_zero_row = shift.clone()
    no_zero_row[1, 2] = -100.0
    for other in (torch.randn(3, 16, 16), two_values, nan, no_zero_row, -shift.abs() - 1):
        assert mask_structure(other)[1][0] == 0


def test_mask_structure_is_kept_on_the_mask_until_it_changes(monkeypatch):
    """Eager calls with the same mask tensor find its region structure once; an in-place
    change of the mask (here: no longer region-structured) is seen by the next call, whose
    output follows the new mask (multi-block path, N = 144)."""
    from timm_flashwin.kernels import bias_mask
    found = []
    monkeypatch.setattr(bias_mask, "mask_structure", lambda m: (found.append(1), mask_structure(m))[1])
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    first = window_attention(case.qkv, 3, **case.kwargs())
    assert torch.equal(window_attention(case.qkv, 3, **case.kwargs()), first) and len(found) == 1
    with torch.no_grad():
        case.mask[1, :, :5] -= 7.0
    changed = window_attention(case.qkv, 3, **case.kwargs())
    assert len(found) == 2
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(changed, expected) < TOLERANCE[torch.float32]


def _record_launches(monkeypatch, flags=("FROM_REGIONS",)) -> list:
    """(kernel name, *the values of ``flags``) of every kernel launch from here on, recorded
    where the attention kernels' host side launches them (``launcher`` as launch.py and
    bias_mask.py call it): the GPU's direct launches, which skip ``wrap_triton``, as well
    as the interpreter's and traced ones."""
    from timm_flashwin.kernels import bias_mask, launch, launcher as launcher_module
    launches, real_launcher = [], launcher_module.launcher

    def recording(kernel):
        launcher = real_launcher(kernel)

        class Recorded:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launches.append((kernel.__name__, *(kwargs.get(flag) for flag in flags)))
                    return launcher[grid](*args, **kwargs)
                return run
        return Recorded()

    for module in (launch, bias_mask):
        monkeypatch.setattr(module, "launcher", recording)
    return launches


def test_eager_launches_ask_for_fma_contraction(monkeypatch):
    """Every kernel of an eager forward + backward, the float16 bias copy included, is
    launched with ``enable_fp_fusion=True`` (``launcher.compiler_options``): the kernels were
    measured and their precision stated with multiply-adds contracted, which Triton stops
    doing by default from 3.10."""
    case = make_case(4, 2, 3, 144, 16, cosine=True, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    launches = _record_launches(monkeypatch, ("enable_fp_fusion",))
    forward_backward(window_attention, case)
    kernels = {name for name, _ in launches}
    assert {"float16_bias_copy_kernel", "window_attention_fwd_kernel", "window_attention_bwd_delta_kernel",
            "window_attention_bwd_dkdv_kernel"} <= kernels, kernels
    assert all(fusion is True for _, fusion in launches), launches


@pytest.mark.parametrize("structured", [True, False], ids=["timm-mask", "dense-mask"])
def test_eager_calls_launch_only_the_build_of_the_masks_kind(structured, monkeypatch):
    """The kernels that stream key blocks are built once per kind of mask. The first eager
    call with a mask launches both builds (its kind is on the device only: a mask built
    anew in every call costs no synchronization); from the second call with the same mask
    on, whose kind was then read once on the host, only the build of that kind runs
    (forward and dkdv kernel). Results match the reference either way."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    if not structured:
        case.mask = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    launches = _record_launches(monkeypatch)
    for call in range(2):
        launches.clear()
        results = forward_backward(window_attention, case)
        streaming = [(name, kind) for name, kind in launches if kind is not None]
        kinds = (True, False) if call == 0 else (structured,)
        assert streaming == ([("window_attention_fwd_kernel", kind) for kind in kinds]
                             + [("window_attention_bwd_dkdv_kernel", kind) for kind in kinds])
        assert_matches_reference(results, reference_forward_backward(case), 1e-4)


def test_inference_tensor_masks_launch_both_builds(monkeypatch):
    """A mask made under torch.inference_mode keeps no structure (no version counter):
    its kind stays on the device, both builds are launched, the other one's programs
    return at once, and the output is the reference's."""
    case = make_case(4, 2, 3, 144, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    launches = _record_launches(monkeypatch)
    with torch.inference_mode():
        mask = case.mask.clone()
        out = window_attention(case.qkv, 3, **case.kwargs(mask=mask))
    assert launches == [("window_attention_fwd_kernel", True), ("window_attention_fwd_kernel", False)]
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_inference_tensors_are_not_kept_on(dtype, monkeypatch):
    """Bias and mask made under torch.inference_mode (a mask timm computes in the forward,
    a bias gathered there) have no version counter: what is derived from them (float32:
    the mask's region structure, a contiguous bias; 16-bit inputs: the float16 copy of
    bias + mask) is computed in every call, not kept."""
    from timm_flashwin.kernels import bias_mask
    found = []
    monkeypatch.setattr(bias_mask, "mask_structure", lambda m: (found.append(1), mask_structure(m))[1])
    copies = []
    real_copy = bias_mask._log2e_float16_copy
    monkeypatch.setattr(bias_mask, "_log2e_float16_copy", lambda *a: (copies.append(1), real_copy(*a))[1])
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=dtype, device=KERNEL_DEVICE)
    with torch.inference_mode():
        bias, mask = case.bias.clone(), case.mask.clone()
        outs = [window_attention(case.qkv, 3, bias=bias, mask=mask, scale=case.scale) for _ in range(2)]
    assert (len(found), len(copies)) == ((2, 0) if dtype == torch.float32 else (0, 2))
    assert torch.equal(outs[0], outs[1])
    assert "_flashwin_streamed_bias" not in bias.__dict__ and "_flashwin_mask_structure" not in mask.__dict__
    expected = window_attention_reference(case.qkv.double(), 3, **case.kwargs(mask=case.mask.double()))
    assert relative_error(outs[0], expected) < TOLERANCE[dtype]


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


def _record_bias_reads(monkeypatch):
    """The (dtype, contiguous) of every bias the launchers hand to a kernel."""
    from timm_flashwin.kernels import launch
    seen = []
    real = launch.bias_mask_args
    monkeypatch.setattr(launch, "bias_mask_args", lambda bias, *rest: (
        seen.append((bias.dtype, bias.is_contiguous())), real(bias, *rest))[1])
    return seen


@pytest.mark.parametrize("n", [49, 144])
def test_transposed_bias_reaches_streaming_kernels_contiguous(n, monkeypatch, deterministic_algorithms):
    """SwinV2-CR's bias is a transposed view (column stride H). Kernels that stream key
    blocks (N = 144) get it copied into rows, one copy for both passes; one-tile windows
    (N = 49) read it as it is. Either way, the same output and bias gradient as with a
    contiguous bias, to the last bits only: on a GPU the kernel built for strided bias
    reads is not the unit-stride one (6 of 7203 bias-gradient values of ~1e-23, near
    fp32's denormals, differed in their last bits, H200). In deterministic mode: the
    multi-block backward's atomic adds round in the order they land (on an H100 the bias
    gradients of two calls then differed beyond rtol 1e-5)."""
    case = make_case(4, 2, 3, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    transposed = case.bias.permute(1, 2, 0).contiguous().permute(2, 0, 1).detach().requires_grad_()
    assert not transposed.is_contiguous()
    seen = _record_bias_reads(monkeypatch)
    out = window_attention(case.qkv, 3, **dict(case.kwargs(), bias=transposed))
    out.backward(case.grad_out)
    assert seen == [(torch.float32, n == 144)] * 2
    expected_bias = case.bias.detach().clone().requires_grad_()
    expected = window_attention(case.qkv, 3, **dict(case.kwargs(), bias=expected_bias))
    expected.backward(case.grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(transposed.grad, expected_bias.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [49, 144])
def test_streaming_kernels_read_a_float16_bias(dtype, n, monkeypatch):
    """With 16-bit inputs the kernels that stream key blocks (N = 144) read a float16 copy
    of a float32 bias, made once for both passes; one-tile windows read the float32 bias.
    The gradient is the float32 bias's, within the dtype's tolerance of float64."""
    case = make_case(4, 2, 3, n, 32, cosine=False, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=3)
    assert case.bias.dtype == torch.float32
    seen = _record_bias_reads(monkeypatch)
    results = forward_backward(window_attention, case)
    assert seen == [(torch.float16 if n == 144 else torch.float32, True)] * 2
    assert results[2].dtype == torch.float32
    exact_bias = forward_backward(window_attention_reference, case, torch.float64)  # not bias_as_read
    assert_matches_reference(results, exact_bias, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_float16_bias_copy_moves_the_logit_scale_gradient_as_its_rounding_does(dtype):
    """Cosine attention streaming key blocks with 16-bit inputs reads a float16 copy of the
    bias. Against the exact bias, the output and the qkv and bias gradients stay within the
    dtype's tolerance; the logit-scale gradient, a sum whose terms cancel, moves by as much
    as the rounding of the bias moves it in float64 (a few 1e-2 where it is small), and
    against the rounded bias (the other tests' reference) it is within tolerance."""
    case = make_case(4, 2, 2, 144, 16, cosine=True, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=144)
    results = forward_backward(window_attention, case)
    exact = forward_backward(window_attention_reference, case, torch.float64)
    rounded = reference_forward_backward(case)
    assert not torch.equal(rounded[2], exact[2])  # the rounded bias is what the reference took
    assert_matches_reference(results[:3], exact[:3], TOLERANCE[dtype])
    assert_matches_reference(results, rounded, TOLERANCE[dtype])
    rounding_effect = (rounded[3] - exact[3]).abs()
    assert ((results[3] - exact[3]).abs() <= 1.5 * rounding_effect + TOLERANCE[dtype] * exact[3].abs()).all()


def test_one_bias_serves_float32_and_16bit_inputs_in_turn():
    """The copy of the bias that the streaming kernels read is kept on the bias tensor: a
    contiguous copy for float32 inputs, a float16 copy times log2(e) for 16-bit ones. The
    same (non-contiguous) bias used with float32, then float16, then float32 inputs again
    gets the copy each needs, and each output matches the reference."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    bias = case.bias.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    for dtype in (torch.float32, torch.float16, torch.float32):
        qkv = case.qkv.to(dtype)
        out = window_attention(qkv, 3, bias=bias, mask=case.mask, scale=case.scale)
        rounded = bias_as_read(replace(case, qkv=qkv, bias=bias)).bias
        expected = window_attention_reference(qkv.double(), 3, bias=rounded.double(), mask=case.mask.double(),
                                              scale=case.scale)
        assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy cast
def test_bias_beyond_float16_range_gives_nan_rows():
    """A float32 bias value beyond float16's range (65504), with bf16 inputs on the
    streaming kernels, turns its row into NaN rather than into a silently different row;
    -inf in the bias still masks, and float32 inputs read the bias as it is."""
    case = make_case(4, 2, 3, 144, 16, cosine=False, masked=False, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    bias = case.bias.detach().clone()
    bias[1, 7, 3] = 1e5
    bias[0, 2, :100] = float("-inf")
    out = window_attention(case.qkv, 3, bias=bias, scale=case.scale)
    nan_rows = out.isnan().any(-1)
    assert nan_rows[:, 7].all() and nan_rows.sum() == 4  # query 7 of every window; head 1's columns only
    assert out[..., 16:32].isnan().any() and not out[..., :16].isnan().any()
    reference = window_attention_reference(case.qkv.double(), 3, bias=bias.double(), scale=case.scale)
    torch.testing.assert_close(out[:, :, :16].double(), reference[:, :, :16], rtol=2e-2, atol=2e-2)
    out32 = window_attention(case.qkv.float(), 3, bias=bias, scale=case.scale)
    assert not out32.isnan().any()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy cast
def test_float16_copy_folds_the_mask_into_the_bias():
    """The copy the streaming kernels read with 16-bit inputs: (bias[h] + mask[w]) * log2(e)
    per (window, head), rounded to float16; a finite sum beyond float16's range is NaN where
    positive and float16's lowest where negative (a mask of -1e9); +-inf and NaN stay."""
    from timm_flashwin.kernels.bias_mask import _log2e_float16_copy
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(3, 9, 9, generator=g).permute(0, 2, 1).to(KERNEL_DEVICE)  # strided, as SwinV2-CR's
    mask = torch.where(torch.rand(2, 9, 9, generator=g) < 0.3, -100.0, 0.0).to(KERNEL_DEVICE)
    bias[1, 2, 3], mask[0, 4, 5], mask[1, 0, 1], mask[1, 6, 7] = 1e5, -1e9, float("-inf"), float("nan")
    log2e = 1.4426950408889634

    def expected(exact):
        rounded = exact.half()
        beyond = exact.isfinite() & rounded.isinf()
        rounded[beyond & (exact > 0)] = float("nan")
        rounded[beyond & (exact < 0)] = -65504.0
        return rounded.float()

    copy = _log2e_float16_copy(bias, mask)
    assert copy.shape == (2, 3, 9, 9) and copy.dtype == torch.float16 and copy.is_contiguous()
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(copy.float(), expected((bias[None] + mask[:, None]).float() * log2e), **same)
    assert copy[0, 1, 2, 3].isnan() and copy[0, :, 4, 5].eq(-65504).all() and copy[1, :, 0, 1].eq(float("-inf")).all()
    assert copy[1, :, 6, 7].isnan().all()
    torch.testing.assert_close(_log2e_float16_copy(None, mask)[:, 0].float(), expected(mask.float() * log2e), **same)
    torch.testing.assert_close(_log2e_float16_copy(bias, None)[0].float(), expected(bias.float() * log2e), **same)


def test_masks_fold_into_the_bias_copy_where_it_is_small():
    """16-bit inputs fold the mask into the streaming kernels' float16 bias copy where that
    (nW, H, N, N) copy is at most config.FOLDED_MASK_MAX_BYTES: window 16 of the benchmarks
    (16 mask windows, 3 heads, 256 tokens: 6.3 MB) does, window 24 (16, 4, 576: 42.5 MB)
    reads the mask's region ids; float32 inputs always do."""
    from timm_flashwin.kernels.bias_mask import folds_mask
    assert folds_mask(torch.bfloat16, 3, 16, 256) and folds_mask(torch.float16, 4, 16, 144)
    assert not folds_mask(torch.bfloat16, 4, 16, 576) and not folds_mask(torch.float32, 3, 16, 256)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_16bit_streaming_kernels_read_the_mask_folded_into_the_bias(cosine, with_bias, monkeypatch):
    """With 16-bit inputs the kernels that stream key blocks (N = 144) read the mask folded
    into their float16 bias copy: launched without a mask of their own, and without region
    ids, whatever the mask (here a dense one, not region-structured, with -1e9 entries, a
    fully masked row and a partly masked one). Forward and every gradient as the float64
    reference's; the fully masked row NaN as there."""
    case = make_case(4, 2, 3, 144, 16, cosine=cosine, masked=True, dtype=torch.float16, device=KERNEL_DEVICE,
                     seed=21, with_bias=with_bias)
    mask = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    mask[0, 3, ::2] = -1e9
    mask[1, 5, :] = float("-inf")
    case.mask = mask
    launches = _record_launches(monkeypatch, ("HAS_MASK", "MASK_REGIONS"))
    results = forward_backward(window_attention, case)
    streaming = [name for name, has_mask, regions in launches if regions is not None]
    assert streaming == ["window_attention_fwd_kernel", "window_attention_bwd_dkdv_kernel"] + (
        ["window_attention_bwd_dbias_kernel"] if with_bias and not cosine else [])
    assert all(has_mask is False and not regions for _, has_mask, regions in launches if regions is not None)
    reference = reference_forward_backward(case)
    nan_rows = results[0].isnan().any(-1)
    assert nan_rows[1::2, 5].all() and nan_rows.sum() == 2  # query 5 of the windows b of mask window 1
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
    case.mask = torch.where(mask.isinf(), 0.0, mask)  # no NaN row: every value compared
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.float16])


def _record_stats_shapes(monkeypatch):
    """The shape of the softmax statistics of every forward the op launches."""
    from timm_flashwin import op as op_module
    shapes = []
    real = op_module.attention_forward

    def forward(*args):
        result = real(*args)
        shapes.append(tuple(result[1].shape))
        return result
    monkeypatch.setattr(op_module, "attention_forward", forward)
    return shapes


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_forward_saves_softmax_statistics_only_for_a_backward(cosine, monkeypatch):
    """Windows over 64 tokens: the forward saves the softmax statistics (and, for cosine
    attention, sums the rows' mean score) only where a gradient can follow; the output is
    the same either way, and a backward without them is refused by name."""
    from timm_flashwin.kernels.launch import attention_backward, attention_forward
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
    _, stats, regions, mask_info = attention_forward(qkv, 3, case.bias, case.mask, None, 0.25, False, 0.0, None, False)
    with pytest.raises(RuntimeError, match="saved no softmax statistics"):
        attention_backward(case.grad_out, qkv, with_grad.detach(), stats, regions, mask_info, case.bias, case.mask,
                           None, 3, 0.25, False, True, False)


def test_logit_scale_gradient_stops_at_the_clamp():
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.tensor([1.0, LOGIT_SCALE_MAX - 1e-3, LOGIT_SCALE_MAX + 0.5], device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    d_logit = results[3]
    assert d_logit[0] != 0 and d_logit[1] != 0
    assert d_logit[2] == 0  # clamped: no gradient, as torch.clamp gives
    assert_matches_reference(results, reference_forward_backward(case), 1e-4)


def test_logit_scale_at_the_bound_follows_torch_clamp():
    """At exactly float32(ln 100) the gradient is whatever timm's own float32
    torch.clamp gives on this device."""
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.full((3,), LOGIT_SCALE_MAX, device=KERNEL_DEVICE)
    d_logit = forward_backward(window_attention, case)[3]
    ls = case.logit_scale.clone().requires_grad_()
    torch.clamp(ls, max=LOGIT_SCALE_MAX).exp().sum().backward()
    assert torch.equal(d_logit != 0, ls.grad != 0)


@pytest.mark.parametrize("n", [16, 144], ids=["one-tile", "multi-block"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_fully_masked_row_is_nan_like_the_reference(cosine, n):
    """Also the dense-mask fallback of the multi-block kernels: this mask is not
    region-structured."""
    case = make_case(4, 2, 3, n, 16, cosine=cosine, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    mask = case.mask.clone()
    mask[1, 5, :] = float("-inf")  # window 1, query 5: nothing to attend to
    mask[0, 3, ::2] = float("-inf")  # partly masked: still finite
    assert mask_structure(mask)[1][0] == 0
    case.mask = mask
    results = forward_backward(window_attention, case)
    reference = reference_forward_backward(case)
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
        scale = max(1.0, ref.nan_to_num(0.0).abs().max().item())  # cancelling sums keep their terms' rounding
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
    assert results[0][1::2, 5].isnan().all() and not results[0][0::2].isnan().any()


def test_nan_input_propagates_like_the_reference():
    case = make_case(4, 2, 3, 16, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    case.qkv = case.qkv.clone()
    case.qkv[2, 7, 0] = float("nan")  # a query element of head 0 in window 2
    out = window_attention(case.qkv, 3, **case.kwargs())
    ref = window_attention_reference(case.qkv.double(), 3, **case.kwargs())
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()



@triton.jit
def head_scales_kernel(logit_scale_ptr, out_ptr):
    """out[h] = the head scale the kernels compute from logit_scale[h]."""
    h = tl.program_id(0)
    tl.store(out_ptr + h, head_scale(logit_scale_ptr, h, 1.0, True))


def test_head_scale_is_exp_of_the_clamped_logit_scale_within_half_an_ulp():
    """The kernels compute s = exp(min(logit_scale, ln 100)) themselves (tiles.head_scale),
    one value that multiplies every logit (up to 100): within half a float32 ulp of the
    exact value, as precise as torch's own float32 exp or better (float32 tl.exp is 3 to
    5 ulp off, enough to move float32 SwinV2 gradients past timm's own error)."""
    logit_scale = torch.cat([torch.linspace(-3.0, 5.0, 253), torch.tensor([LOGIT_SCALE_MAX, 4.6051702, 1e-3])])
    logit_scale = logit_scale.to(KERNEL_DEVICE)
    out = torch.empty_like(logit_scale)
    head_scales_kernel[(logit_scale.numel(),)](logit_scale, out)
    exact = torch.clamp(logit_scale, max=LOGIT_SCALE_MAX).double().exp()  # clamped in float32, as torch.clamp does
    ulp = torch.finfo(torch.float32).eps * exact.float().abs().double()  # spacing above 2^k, 2 ulp below
    assert ((out.double() - exact).abs() <= 0.5 * ulp).all()


@pytest.mark.parametrize("n", [16, 144], ids=["one-tile", "multi-block"])
def test_nan_logit_scale_propagates_like_torch_clamp(n):
    """The kernels clamp and exponentiate the logit scale themselves: a NaN one gives its
    head NaN outputs and gradients, the other heads stay finite, and its own gradient is
    0 (torch.clamp's backward compares, and NaN <= ln 100 is false), as in the reference."""
    case = make_case(4, 2, 3, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    case.logit_scale = torch.tensor([1.0, float("nan"), 2.0], device=KERNEL_DEVICE)
    results = forward_backward(window_attention, case)
    reference = reference_forward_backward(case)
    for got, ref in zip(results, reference):
        assert torch.equal(got.isnan(), ref.isnan())
    assert results[0][..., 16:32].isnan().all() and not results[0][..., :16].isnan().any()
    assert results[3][1] == 0 and results[3][[0, 2]].isfinite().all()
    finite = [torch.nan_to_num(t) for t in results]
    assert_matches_reference(finite, [torch.nan_to_num(t) for t in reference], 1e-4)


def test_lse_output_is_not_differentiable_and_op_is_registered():
    assert hasattr(torch.ops.timm_flashwin, "window_attention_fwd")
    assert hasattr(torch.ops.timm_flashwin, "window_attention_bwd")


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
    from timm_flashwin import op
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
    from timm_flashwin import op
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
    from timm_flashwin.dispatch import dispatch_free
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
    from timm_flashwin import op
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


# ----------------------------------------------------------------------------- bad input
def _ok(**override):
    case = make_case(4, 2, 2, 9, 8, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    args = dict(qkv=case.qkv, num_heads=2, bias=case.bias, mask=case.mask, scale=case.scale, logit_scale=None)
    args.update(override)
    return args


def z(*shape, dtype=torch.float32, device=KERNEL_DEVICE):
    """Zeros on the kernel device, so that each bad input fails the check it names."""
    return torch.zeros(*shape, dtype=dtype, device=device)


def _call(args):
    args = dict(args)
    return window_attention(args.pop("qkv"), args.pop("num_heads"), **args)


BAD_INPUTS = [
    ("qkv", TypeError, lambda: _ok(qkv=[[1.0]])),
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9))),
    ("qkv", TypeError, lambda: _ok(qkv=z(4, 9, 48, dtype=torch.int32))),
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 50))),  # not divisible by 3 * H
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 0))),  # head_dim 0
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 9, 3 * 2 * 264))),  # head_dim 264 > 256
    ("qkv", ValueError, lambda: _ok(qkv=z(4, 1025, 48), bias=None, mask=None)),  # N > 1024
    ("num_heads", ValueError, lambda: _ok(num_heads=0)),
    ("num_heads", ValueError, lambda: _ok(num_heads=2.0)),
    ("bias", ValueError, lambda: _ok(bias=z(2, 9, 8))),
    ("bias", ValueError, lambda: _ok(bias=z(3, 9, 9))),
    ("bias", ValueError, lambda: _ok(bias=z(2, 2, 9, 9))),
    ("bias", TypeError, lambda: _ok(bias=z(2, 9, 9, dtype=torch.float64))),
    ("bias", TypeError, lambda: _ok(bias="table")),
    ("mask", ValueError, lambda: _ok(mask=z(3, 9, 9))),  # 3 does not divide B_ = 4
    ("mask", ValueError, lambda: _ok(mask=z(2, 9, 8))),
    ("mask", ValueError, lambda: _ok(mask=z(2, 1, 9, 9))),
    ("mask", TypeError, lambda: _ok(mask=z(2, 9, 9, dtype=torch.bool))),
    ("scale", TypeError, lambda: _ok(scale="0.1")),
    ("scale", TypeError, lambda: _ok(scale=None)),  # neither scale nor logit_scale
    ("logit_scale", TypeError, lambda: _ok(logit_scale=z(2))),  # both given
    ("logit_scale", ValueError, lambda: _ok(scale=None, logit_scale=z(3))),
    ("logit_scale", ValueError, lambda: _ok(scale=None, logit_scale=z(2, 2))),
    ("dropout_p", ValueError, lambda: _ok(dropout_p=1.0)),
    ("dropout_p", ValueError, lambda: _ok(dropout_p=-0.1)),
    ("dropout_p", ValueError, lambda: _ok(dropout_p="0.1")),
]
if HAS_CUDA:
    BAD_INPUTS.append(("bias", ValueError, lambda: _ok(bias=z(2, 9, 9, device="cpu"))))
else:
    BAD_INPUTS.append(("bias", ValueError, lambda: _ok(bias=z(2, 9, 9, device="meta"))))


@pytest.mark.parametrize("argument,error,make_args", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _, _) in
                                                                      enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(argument, error, make_args):
    with pytest.raises(error, match=f"`{argument}`"):
        _call(make_args())


def test_bad_input_message_says_expected_and_got():
    with pytest.raises(ValueError) as info:
        _call(_ok(mask=z(3, 9, 9)))
    assert "nW dividing B_ = 4" in str(info.value) and "nW = 3" in str(info.value)


# ----------------------------------------------------------------------------- GPU only
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
    from timm_flashwin.kernels import backward, forward
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
    from timm_flashwin.position_bias import gather_position_bias
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
