"""Launch plans (kernels/window/plan.py): decided once per signature, looked up afterwards, and
deciding what the launchers' tensors say they read."""
import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import make_case
from timm_flashwin import window_attention
from timm_flashwin.kernels.window import config
from timm_flashwin.kernels.window import plan
from timm_flashwin.kernels.window.bias_mask import streamed_bias


@pytest.fixture(autouse=True)
def fresh_plans():
    plan.clear()
    yield
    plan.clear()


def _forward(case, **kw):
    return plan.forward_plan(case.qkv, case.num_heads, case.bias is not None, case.mask, case.logit_scale is not None,
                             False, True, None, False, 0.0, traced=False, **kw)


def test_one_plan_per_signature():
    case = make_case(4, 2, 2, 49, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    first = _forward(case)
    assert _forward(case) is first  # looked up, not decided again
    other_batch = make_case(8, 2, 2, 49, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    assert _forward(other_batch) is not first
    other_dtype = make_case(4, 2, 2, 49, 16, cosine=False, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    assert _forward(other_dtype) is not first
    no_mask = make_case(4, 2, 2, 49, 16, cosine=False, masked=False, dtype=torch.float32, device=KERNEL_DEVICE)
    assert _forward(no_mask) is not first and not _forward(no_mask).flags.has_mask


def test_backward_plans_follow_the_deterministic_mode(deterministic_algorithms):
    case = make_case(4, 2, 2, 144, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    args = (case.qkv, 2, True, case.mask, True, True, True, False, None, False, 0.0)
    deterministic = plan.backward_plan(*args, traced=False)
    assert not deterministic.dq_atomic and deterministic.slots == 0 and not deterministic.atomic_sum
    torch.use_deterministic_algorithms(False)
    assert plan.backward_plan(*args, traced=False).dq_atomic


def test_overrides_and_traced_launches_are_decided_every_call(monkeypatch):
    case = make_case(4, 2, 2, 49, 16, cosine=False, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    assert _forward(case) is _forward(case)
    key = ("fwd", 49, 16, torch.float32, False)
    monkeypatch.setitem(config.OVERRIDES, key, config.forward_config(49, 16, torch.float32, False))
    assert _forward(case) is not _forward(case)
    monkeypatch.delitem(config.OVERRIDES, key)
    traced = lambda: plan.forward_plan(case.qkv, 2, True, case.mask, False, False, True, None, False, 0.0,  # noqa: E731
                                       traced=True)
    assert traced() is not traced()


class _UnhashableSize(int):
    """An int that cannot be hashed, as a SymInt under an operator's dynamic-shape dispatch."""

    def __hash__(self):
        raise TypeError("unhashable type: non-nested SymInt")


def test_call_plans_are_kept_for_plain_sizes_only():
    """A call's plan is kept per signature of plain ints and bools; a symbolic size (any
    other type: a SymInt, which cannot be hashed) gets the same answers, not kept."""
    from timm_flashwin.kernels.arch import INTERPRETER
    kept = plan.call_plan(64, 32, torch.float32, True, False, INTERPRETER)
    assert kept is plan.call_plan(64, 32, torch.float32, True, False, INTERPRETER)
    for n, head_dim in ((_UnhashableSize(64), 32), (64, _UnhashableSize(32))):
        assert plan.call_plan(n, head_dim, torch.float32, True, False, INTERPRETER) == kept


def test_settings_are_part_of_the_signature(monkeypatch):
    case = make_case(4, 2, 2, 144, 16, cosine=False, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    folded = _forward(case)
    monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    apart = _forward(case)
    assert folded.flags.has_mask is False and apart.flags.has_mask is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [49, 144])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("fold", [False, True], ids=["apart", "folded"])
def test_plan_flags_are_what_the_launch_reads(dtype, n, with_bias, masked, fold, monkeypatch):
    """The plan decides HAS_BIAS, HAS_MASK and BIAS_LOG2E from the signature; the launchers
    get the tensors from ``streamed_bias``: the same answers (launch._check_flags also
    checks every launch)."""
    if not fold:
        monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    case = make_case(4, 2, 2, n, 16, cosine=False, masked=masked, dtype=dtype, device=KERNEL_DEVICE,
                     with_bias=with_bias)
    forward = _forward(case)
    bias, mask, log2e = (streamed_bias(case.bias, case.mask, dtype, 2) if forward.streams
                         else (case.bias, case.mask, False))
    assert (forward.flags.has_bias, forward.flags.has_mask, forward.flags.log2e) == (
        bias is not None, mask is not None, log2e)
    kwargs = forward.kwargs[False]
    assert (kwargs["HAS_BIAS"], kwargs["HAS_MASK"], kwargs["BIAS_LOG2E"]) == (
        bias is not None, mask is not None, log2e)


def test_calls_with_a_plan_and_without_agree():
    """The op's results with plans kept and with every plan decided anew."""
    case = make_case(4, 2, 2, 49, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    first = window_attention(case.qkv, 2, **case.kwargs())
    second = window_attention(case.qkv, 2, **case.kwargs())  # from the kept plan
    plan.clear()
    third = window_attention(case.qkv, 2, **case.kwargs())
    assert torch.equal(first, second) and torch.equal(first, third)
