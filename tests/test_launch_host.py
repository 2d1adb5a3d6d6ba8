"""benchmarks/launch_host.py counts and times what its docstring says: every launch of every
autotuner, once, split into ours (the kernels of timm_flashwin.kernels) and inductor's, per
step after an uncounted first one; and the autotuners are left as they were."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from launch_host import LaunchTimer, kernel_name, launch_host, our_kernel_names  # noqa: E402


class FakeTuner:
    """What inductor's wrapper calls: ``tuner.run(*args, stream=...)``."""

    def __init__(self, name, seconds=0.0):
        self.inductor_meta = {"kernel_name": name}
        self.seconds = seconds
        self.calls = 0

    def run(self, *args, stream=None):
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)
        return args


def test_kernel_names():
    assert kernel_name(FakeTuner("window_attention_fwd_kernel_0")) == "window_attention_fwd_kernel"
    assert kernel_name(FakeTuner("triton_poi_fused__to_copy_21")) == "triton_poi_fused__to_copy"
    ours = our_kernel_names()
    assert {"window_attention_fwd_kernel", "relative_bias_table_grad_kernel", "local_attention_fwd_kernel"} <= ours
    assert "triton_poi_fused__to_copy" not in ours


def test_launches_counted_per_step_by_owner():
    forward = FakeTuner("window_attention_fwd_kernel_0", seconds=0.002)
    table = FakeTuner("relative_bias_table_grad_kernel_1")
    fused = FakeTuner("triton_poi_fused_add_3")
    tuners = [forward, table, fused]

    def step():
        assert forward.run(1, 2, stream=0) == (1, 2)  # arguments and result pass through
        forward.run(stream=0)
        table.run(torch.empty(0), 7, stream=0)
        for _ in range(3):
            fused.run(5, stream=0)

    found = launch_host(step, steps=4, sync=lambda: None, tuners=tuners)
    assert (forward.calls, table.calls, fused.calls) == (10, 5, 15)  # the first step ran, uncounted
    assert found["ours"]["launches"] == 3 and found["inductor"]["launches"] == 3
    names = [k[0] for k in found["ours"]["kernels"]]
    assert names == ["window_attention_fwd_kernel", "relative_bias_table_grad_kernel"]  # by host time
    # the arguments of each kernel's latest call, and the tensors among them
    assert [k[3:] for k in found["ours"]["kernels"]] == [(0, 0), (2, 1)]
    assert found["inductor"]["kernels"][0][3:] == (1, 0)
    assert found["ours"]["host_us"] >= 2 * 2000  # two sleeps of 2 ms a step
    assert found["inductor"]["host_us"] < found["ours"]["host_us"]
    assert found["ours"]["us_per_launch"] == found["ours"]["host_us"] / 3
    # the instances' own attribute removed: the class's run again
    assert all("run" not in vars(t) for t in tuners)


def test_a_tuner_is_timed_once():
    tuner = FakeTuner("window_attention_fwd_kernel_0")
    with LaunchTimer([tuner]) as outer:
        with LaunchTimer([tuner]) as inner:
            tuner.run(stream=0)
        assert inner.tuners == []
        assert outer.totals["window_attention_fwd_kernel"][0] == 1
    assert "run" not in vars(tuner)
