"""benchmarks/bench_rel_pos.py times what its docstring says: timm's road, FlexAttention's
score_mod and ours compute the same attention of the same inputs (on the CPU, small: ours
through the interpreter, Flex uncompiled)."""
import os
import sys

import torch

from conftest import KERNEL_DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_rel_pos  # noqa: E402


def test_implementations_compute_the_same_attention():
    from torch.nn.attention.flex_attention import flex_attention
    shape = (2, 2, 4, 16)
    tensors = [t.detach() for t in bench_rel_pos.inputs(shape, torch.float32, KERNEL_DEVICE)]
    outs = {impl: bench_rel_pos.attention(impl, 4, flex_attention)(*tensors) for impl in ("timm", "flex", "flashwin")}
    timm_out = outs["timm"].view(2, 2, 16, 16)  # timm's (B * heads, N, D)
    for impl in ("flex", "flashwin"):
        assert ((outs[impl] - timm_out).norm() / timm_out.norm()).item() < 1e-5, impl
    plain = bench_rel_pos.attention("sdpa-no-bias", 4)(*tensors)
    assert ((plain - timm_out).norm() / timm_out.norm()).item() > 1e-2  # the bias matters
