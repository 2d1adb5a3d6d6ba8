"""benchmarks/bench_local.py measures what its tables say: its visible-pair counts (the
TFLOP/s denominators), FlexAttention's mask_mod and the dense SDPA mask are the pattern
our operators compute, and every case maps onto our API as stated. On the CPU, no kernel."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_local  # noqa: E402
from timm_flashwin.ops.local_reference import LocalPattern, block_window_visible, sliding_window_visible

PATTERNS = [
    (LocalPattern.sliding(250, 249), sliding_window_visible(250, 249)),
    (LocalPattern.sliding(None, 0), sliding_window_visible(None, 0)),
    (LocalPattern.sliding(None, None), sliding_window_visible(None, None)),
    (LocalPattern.blocks(256, 4), block_window_visible(256, 4)),
    (LocalPattern.blocks(100, 3, 130), block_window_visible(100, 3, 130)),
]


@pytest.mark.parametrize("pattern,visible", PATTERNS)
@pytest.mark.parametrize("seq_len", [1, 300, 1111])
def test_visible_pairs_and_masks_are_the_pattern(pattern, visible, seq_len):
    rows = torch.arange(seq_len)
    dense = visible(rows[:, None], rows[None, :])
    assert bench_local.visible_pairs(pattern, seq_len) == int(dense.sum())
    assert torch.equal(pattern.visible()(rows[:, None], rows[None, :]), dense)  # sdpa_mask's
    assert torch.equal(bench_local.mask_mod(pattern)(0, 0, rows[:, None], rows[None, :]), dense)  # flex's


def test_every_case_calls_our_api_with_its_pattern(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_local, "sliding_window_attention", lambda q, k, v, **kw: seen.append(kw))
    monkeypatch.setattr(bench_local, "block_sliding_window_attention", lambda q, k, v, **kw: seen.append(kw))
    for case in bench_local.CASES.values():
        bench_local.ours(case.pattern)(None, None, None)
        kw = seen.pop()
        if "window" in kw:
            left, right = kw["window"]
            assert LocalPattern.sliding(left, right) == case.pattern
        else:
            assert LocalPattern.blocks(kw["block_size"], kw["window_blocks"], kw["sink_tokens"]) == case.pattern


@pytest.mark.parametrize("pattern", [LocalPattern.sliding(40, 20), LocalPattern.blocks(30, 2, 17)],
                         ids=["window", "frames-sink"])
def test_implementations_agree_on_a_small_case(pattern):
    """Ours (the interpreter's kernels on the CPU), FlexAttention (uncompiled, its BlockMask
    of 128-blocks straddling the pattern) and SDPA with the dense mask compute one thing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from conftest import KERNEL_DEVICE
    case = bench_local.Case(pattern, 1, 2, 1, 16, (150,))
    q, k, v, _ = (t.detach().float() for t in bench_local.make_inputs(case, 150, device=KERNEL_DEVICE))
    mine = bench_local.ours(pattern)(q, k, v)
    dense = bench_local.sdpa_mask(pattern, 150, q.device)(q, k, v)
    block_mask = create_block_mask(bench_local.mask_mod(pattern), None, None, 150, 150, device=q.device)
    flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert bench_local.relative_error(dense, mine) < 1e-5 and bench_local.relative_error(flex, mine) < 1e-5


def test_rounds_alternate_the_implementations_and_report_medians(monkeypatch):
    """run_case's rounds: each implementation measured once in full (``bench_one``), then
    timed again each round in a rotated order; the rows hold every round's ms and their
    medians (the TFLOP/s from the medians). The timings are stubbed: no GPU here."""
    from conftest import KERNEL_DEVICE
    calls, times = [], iter(range(100, 200))
    monkeypatch.setattr(bench_local, "make_inputs",
                        lambda case, seq_len: tuple(torch.zeros(1, 1, seq_len, 8, device=KERNEL_DEVICE)
                                                    for _ in range(4)))
    monkeypatch.setattr(bench_local, "ours", lambda pattern: lambda q, k, v: q)
    monkeypatch.setattr(bench_local, "implementation", lambda impl, *args: (lambda q, k, v: q))
    monkeypatch.setattr(bench_local, "bench_one", lambda fn, inputs, rep: dict(
        fwd_ms=1.0, fwdbwd_ms=10.0, fwdbwd_peak_mib=0.0, fwd_host_ms=0.0, fwdbwd_host_ms=0.0))

    def time_pass(fn, inputs, forward_only, rep):
        calls.append(forward_only)
        return float(next(times))
    monkeypatch.setattr(bench_local, "_time_pass", time_pass)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    case = bench_local.Case(LocalPattern.sliding(4, 0), 1, 1, 1, 8, (32,))
    rows = []
    bench_local.run_case("c", case, (32,), ["ours", "flex"], 10, 256.0, rows, lambda: None, rounds=3)
    assert [r["impl"] for r in rows] == ["ours", "flex"] and len(calls) == 8
    ours, flex = rows
    # round 2 times flex first (100, 101), then ours (102, 103); round 3 ours (104, 105), flex
    assert ours["fwd_ms_rounds"] == [1.0, 102.0, 104.0] and ours["fwdbwd_ms_rounds"] == [10.0, 103.0, 105.0]
    assert flex["fwd_ms_rounds"] == [1.0, 100.0, 106.0] and flex["fwdbwd_ms_rounds"] == [10.0, 101.0, 107.0]
    assert ours["fwd_ms"] == 102.0 and flex["fwdbwd_ms"] == 101.0
    pairs = bench_local.visible_pairs(case.pattern, 32)
    assert ours["fwd_tflops"] == pytest.approx(4 * pairs * 8 / 102.0 / 1e9)
