"""Attention dropout inside the kernels: the exact mask the kernels apply (materialized
by kernels/dropout.py from the same seed) against the float64 reference, forward and
every gradient; the drop rate and the expectation; reproducibility from torch's seed."""
import math

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import TOLERANCE, assert_matches_reference, forward_backward, make_case, reference_forward_backward
from timm_flashwin import window_attention, window_attention_reference
from timm_flashwin.kernels.window.dropout import dropout_factors
from timm_flashwin.ops.dropout_seed import draw_dropout_seed


def rng_state():
    return torch.cuda.get_rng_state() if KERNEL_DEVICE == "cuda" else torch.get_rng_state()


def set_rng_state(state):
    (torch.cuda.set_rng_state if KERNEL_DEVICE == "cuda" else torch.set_rng_state)(state)


def with_dropout(p):
    return lambda *args, **kwargs: window_attention(*args, dropout_p=p, **kwargs)


def _dropout_cases():
    """(cosine, n, dtype). N = 144 runs the multi-block forward and backward: on the CPU in
    one dtype per kind (20 s each under the interpreter), every dtype on a GPU."""
    for cosine in (False, True):
        for n in (9, 49, 144):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                cpu_dtype_at_144 = torch.float32 if cosine else torch.float16
                gpu_only = n == 144 and dtype is not cpu_dtype_at_144
                name = f"{'cosine' if cosine else 'v1'}-{n}-{str(dtype).split('.')[-1]}"
                yield pytest.param(cosine, n, dtype, id=name, marks=[pytest.mark.cuda] if gpu_only else [])


@pytest.mark.parametrize("cosine,n,dtype", _dropout_cases())
def test_kernel_dropout_matches_reference_with_the_same_mask(cosine, n, dtype):
    """The reference takes the bias as the kernels read it (``bias_as_read``) and the seed is
    fixed: the mask would otherwise be whatever the tests run before left in the generator."""
    p = 0.3
    torch.manual_seed(n)
    case = make_case(4, 2, 2, n, 16, cosine=cosine, masked=True, dtype=dtype, device=KERNEL_DEVICE, seed=n)
    state = rng_state()
    ours = forward_backward(with_dropout(p), case)
    set_rng_state(state)  # the op drew its seed from here: draw it again
    factor = dropout_factors(draw_dropout_seed(case.qkv.device), 4, 2, n, p)
    dropped = (factor == 0).float().mean().item()
    assert 0.2 < dropped < 0.4
    torch.testing.assert_close(factor.unique(), torch.tensor([0.0, 1 / (1 - p)], device=factor.device))
    assert_matches_reference(ours, reference_forward_backward(case, dropout_factor=factor), TOLERANCE[dtype])


@pytest.mark.parametrize("n", [49, 144])
def test_same_seed_same_result_other_seed_other_mask(n, deterministic_algorithms):
    """Bit-equal gradients from the same seed: in deterministic mode, since on a GPU the
    multi-block backward's atomic adds otherwise round in the order they land."""
    case = make_case(2, 1, 1, n, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(forward_backward(with_dropout(0.5), case))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))  # forward and every gradient
    assert not torch.equal(runs[0][0], runs[2][0])
    assert not torch.equal(runs[0][0], window_attention(case.qkv, 1, **case.kwargs()))


def test_drop_rate_and_expectation():
    """Each probability is dropped with probability p, independently of its position, and
    the output is unbiased: the mean over draws tends to the output without dropout."""
    p, draws = 0.25, 64
    factor = dropout_factors(torch.tensor([99], dtype=torch.int64, device=KERNEL_DEVICE), 8, 4, 49, p)
    kept = (factor > 0).double()
    count = kept.numel()
    sigma = math.sqrt(p * (1 - p) / count)
    assert abs((1 - kept.mean().item()) - p) < 5 * sigma
    # no position is special: the drop rate per (i, j) over windows and heads, and per window
    assert abs(kept.mean((0, 1)) - (1 - p)).max() < 5 * math.sqrt(p * (1 - p) / 32)
    assert abs(kept.mean((1, 2, 3)) - (1 - p)).max() < 5 * math.sqrt(p * (1 - p) / (4 * 49 * 49))

    case = make_case(2, 1, 2, 16, 16, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    expected = window_attention(case.qkv, 2, bias=case.bias, scale=case.scale)
    torch.manual_seed(0)
    outs = torch.stack([window_attention(case.qkv, 2, bias=case.bias, scale=case.scale, dropout_p=p)
                        for _ in range(draws)])
    standard_error = outs.std(0) / math.sqrt(draws)
    z_scores = (outs.mean(0) - expected) / standard_error.clamp_min(1e-6)
    assert z_scores.abs().mean() < 1.2  # |N(0, 1)| averages 0.8
    assert (z_scores.abs() > 5).float().mean() < 0.01


def test_dropout_zero_is_exactly_no_dropout_and_draws_nothing():
    case = make_case(4, 2, 2, 49, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    state = rng_state()
    a = forward_backward(with_dropout(0.0), case)
    assert torch.equal(rng_state(), state)
    b = forward_backward(window_attention, case)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_nan_propagates_through_dropped_probabilities():
    case = make_case(2, 1, 2, 9, 16, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    qkv = case.qkv.clone()
    qkv[0, 3, 0] = float("nan")  # a query of head 0 in window 0: its row of P is NaN
    out = window_attention(qkv, 2, bias=case.bias, scale=case.scale, dropout_p=0.9)
    reference = window_attention_reference(qkv.double(), 2, bias=case.bias.double(), scale=case.scale)
    assert torch.equal(out.isnan(), reference.isnan())


def test_pytorch_path_uses_torch_dropout(monkeypatch):
    """Without kernels (plain CPU), the op applies F.dropout, drawing from torch's CPU
    generator exactly as the reference does."""
    from timm_flashwin.ops import window as op
    monkeypatch.setattr(op, "uses_kernels", lambda qkv: False)
    case = make_case(4, 2, 2, 49, 16, cosine=True, masked=True, dtype=torch.float32, device="cpu")
    kwargs = case.kwargs()
    torch.manual_seed(3)
    out = window_attention(case.qkv, 2, dropout_p=0.2, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(out, window_attention_reference(case.qkv, 2, dropout_p=0.2, **kwargs))
