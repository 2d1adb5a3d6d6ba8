"""Launch plans (kernels/window/plan.py): made once per call description, looked up afterwards,
deciding what the launchers' tensors say they read, and reading nothing but the description."""
import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import make_case
from timm_flashwin import WindowGrid, window_attention
from timm_flashwin.kernels.window import config, plan
from timm_flashwin.kernels.window.bias_mask import streamed_bias
from timm_flashwin.kernels.window.call import DENSE_BIAS, IMAGE_MAJOR_QUERY, LOG2E_COPY, NO_BIAS, TABLE_BIAS, settings
from timm_flashwin.ops import host_program
from window_calls import window_call


@pytest.fixture(autouse=True)
def fresh_plans():
    plan.clear()
    yield
    plan.clear()


def _call(n=49, dtype=torch.float32, **fields):
    """A call of 4 windows, 2 heads of 16 dims, a dense bias and 2 mask windows."""
    fields = dict(dict(windows=4, heads=2, bias=DENSE_BIAS, periods=2), **fields)
    return window_call(n, 16, dtype, fields.pop("cosine", False), **fields)


def test_one_plan_per_call():
    first = plan.forward_plan(_call())
    assert plan.forward_plan(_call()) is first  # looked up, not decided again
    assert plan.forward_plan(_call(windows=8)) is not first
    assert plan.forward_plan(_call(dtype=torch.bfloat16)) is not first
    no_mask = plan.forward_plan(_call(periods=0))
    assert no_mask is not first and not no_mask.has_mask and first.has_mask


def test_backward_plans_follow_the_deterministic_mode(deterministic_algorithms):
    """The mode is part of the call's settings: a call made under it plans no atomic adds."""
    deterministic = plan.backward_plan(_call(144, cosine=True, settings=settings()), True, True)
    assert not deterministic.dq_atomic and deterministic.slots == 0 and not deterministic.atomic_sum
    torch.use_deterministic_algorithms(False)
    assert plan.backward_plan(_call(144, cosine=True, settings=settings()), True, True).dq_atomic


def test_overrides_and_traced_launches_are_decided_every_call(monkeypatch):
    assert plan.forward_plan(_call()) is plan.forward_plan(_call())
    key = ("fwd", 49, 16, torch.float32, False)
    monkeypatch.setitem(config.OVERRIDES, key, config.forward_config(49, 16, torch.float32, False))
    assert plan.forward_plan(_call()) is not plan.forward_plan(_call())
    monkeypatch.delitem(config.OVERRIDES, key)
    monkeypatch.setattr(plan, "traced_launch", lambda: True)
    assert plan.forward_plan(_call()) is not plan.forward_plan(_call())


class _UnhashableSize(int):
    """An int that cannot be hashed, as a SymInt under an operator's dynamic-shape dispatch."""

    def __hash__(self):
        raise TypeError("unhashable type: non-nested SymInt")


def test_plans_are_kept_for_plain_sizes_only():
    """A call's plans are kept by its description where it can be hashed; a symbolic size (a
    SymInt, which cannot be) gets the same answers, not kept."""
    kept = plan.call_plan(_call(64))
    assert kept is plan.call_plan(_call(64))
    for fields in (dict(tokens=_UnhashableSize(64)), dict(windows=_UnhashableSize(4))):
        assert plan.call_plan(_call(64, **fields)) == kept
    assert plan.forward_plan(_call(64, windows=_UnhashableSize(4))).kwargs == plan.forward_plan(_call(64)).kwargs


def test_settings_are_part_of_the_call(monkeypatch):
    """A setting changed after a call was planned makes the next call another description,
    planned anew: the mask read apart once the float16 bias copy may not hold it."""
    folded = plan.forward_plan(_call(144, dtype=torch.bfloat16))
    monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    apart = plan.forward_plan(_call(144, dtype=torch.bfloat16))
    assert folded.has_mask is False and apart.has_mask is True
    for name, value in (("MASK_REGIONS", False), ("MIN_WINDOWS_PER_PROGRAM", 1)):
        before = settings()
        monkeypatch.setattr(config, name, value)
        assert settings() != before


def _calls():
    """Calls of every kind the plans tell apart."""
    grid = WindowGrid(14, 14, (7, 7), (3, 3))
    return [_call(), _call(cosine=True, dropout_p=0.25), _call(bias=NO_BIAS, periods=0),
            _call(bias=TABLE_BIAS, sigmoid=16.0, cosine=True), _call(windows=8, grid=grid),
            _call(query=IMAGE_MAJOR_QUERY, periods=0), _call(144, dtype=torch.bfloat16), _call(144),
            _call(144, dtype=torch.bfloat16, bias=NO_BIAS), _call(144, bias=TABLE_BIAS, save_stats=False),
            _call(256, dtype=torch.bfloat16, cosine=True, heads=4)]


def test_every_setting_a_plan_reads_is_in_its_key(monkeypatch):
    """The plans read the process-wide settings from the call's description (its key) and
    nowhere else: made with ``config``'s settings gone and torch's deterministic flag
    unreadable, the plans of calls of every kind are those made as usual."""
    calls = _calls()
    expected = [(plan.call_plan(c), plan.forward_plan(c), plan.backward_plan(c, True, True)) for c in calls]
    plan.clear()
    for name in ("MASK_REGIONS", "FOLDED_MASK_MAX_BYTES", "MIN_WINDOWS_PER_PROGRAM"):
        monkeypatch.delattr(config, name)

    def unread():
        raise AssertionError("a plan read torch's deterministic flag, not the call's")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", unread)
    for call, made in zip(calls, expected):
        assert (plan.call_plan(call), plan.forward_plan(call), plan.backward_plan(call, True, True)) == made


def test_plans_tell_every_field_of_the_call_apart():
    """No two calls that differ in a field share a plan: each field of the description is
    part of the key (a plan read through a field the key lacked would be shared)."""
    base = _call(144, dtype=torch.bfloat16)
    changed = dict(windows=8, tokens=64, heads=3, head_dim=32, dtype=torch.float16, bias=TABLE_BIAS, sigmoid=16.0,
                   periods=4, cosine=True, scale=0.5, dropout_p=0.1, save_stats=False,
                   grid=WindowGrid(24, 24, (12, 12)), query=IMAGE_MAJOR_QUERY,
                   settings=settings()._replace(folded_mask_max_bytes=0))
    changed["arch"] = base.arch.__class__(**dict(base.arch.__dict__, sm_count=base.arch.sm_count + 1))
    assert set(changed) == set(base._fields)
    first = plan.forward_plan(base)
    for field, value in changed.items():
        assert plan.forward_plan(base._replace(**{field: value})) is not first, field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [49, 144])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("fold", [False, True], ids=["apart", "folded"])
def test_plan_reads_are_what_the_launch_reads(dtype, n, with_bias, masked, fold, monkeypatch):
    """The plan decides the kernels' BIAS and HAS_MASK from the call; the launchers get the
    tensors from ``streamed_bias``: the same answers (launch._check_reads also checks every
    launch)."""
    if not fold:
        monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    case = make_case(4, 2, 2, n, 16, cosine=False, masked=masked, dtype=dtype, device=KERNEL_DEVICE,
                     with_bias=with_bias)
    call = _call(n, dtype=dtype, bias=DENSE_BIAS if with_bias else NO_BIAS, periods=2 if masked else 0)
    forward = plan.forward_plan(call)
    bias, mask = streamed_bias(call, case.bias, case.mask) if forward.streams else (case.bias, case.mask)
    kind = NO_BIAS if bias is None else LOG2E_COPY if forward.streams and dtype != torch.float32 else DENSE_BIAS
    assert (forward.bias, forward.has_mask) == (kind, mask is not None)
    kwargs = forward.kwargs[False]
    assert (kwargs["BIAS"], kwargs["HAS_MASK"]) == (kind, mask is not None)


def test_calls_with_a_plan_and_without_agree():
    """The op's results with plans kept and with every plan decided anew."""
    case = make_case(4, 2, 2, 49, 16, cosine=True, masked=True, dtype=torch.float32, device=KERNEL_DEVICE)
    first = window_attention(case.qkv, 2, **case.kwargs())
    second = window_attention(case.qkv, 2, **case.kwargs())  # from the kept plan
    plan.clear()
    third = window_attention(case.qkv, 2, **case.kwargs())
    assert torch.equal(first, second) and torch.equal(first, third)


def test_a_host_program_is_keyed_by_the_call_and_its_layouts(monkeypatch):
    """An eager call's host-program key (``host_program.call``) is its description, every
    setting included, and its tensors' layouts: a setting changed after a shape was seen is
    another key, whose program is recorded anew (the replay with the new setting: the GPU
    test in test_host_program_replay.py)."""
    keys = []
    monkeypatch.setattr(host_program, "takes", lambda tensor: True)
    monkeypatch.setattr(host_program, "call", lambda key, inputs, road, grad=True: keys.append(key) or road())
    case = make_case(4, 2, 2, 144, 16, cosine=False, masked=True, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    for _ in range(2):
        window_attention(case.qkv, 2, **case.kwargs())
    monkeypatch.setattr(config, "FOLDED_MASK_MAX_BYTES", 0)
    window_attention(case.qkv, 2, **case.kwargs())
    (call, layouts), same, (changed, changed_layouts) = keys
    # the same tensors, and the mask's region ids that the kernels read now
    assert same == (call, layouts) and changed_layouts[:len(layouts)] == layouts and len(changed_layouts) == 5
    assert changed != call and changed._replace(settings=call.settings) == call
    assert changed.settings.folded_mask_max_bytes == 0
