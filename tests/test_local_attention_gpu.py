"""sliding_window_attention and block_sliding_window_attention on a GPU only: long sequences
against a float64 reference computed a chunk of queries at a time, every head_dim and
dtype, dropout, torch.compile with inductor (fullgraph, no recompilation for new lengths,
windows, batches or scales), memory linear in the sequence, opcheck."""
from __future__ import annotations

import pytest
import torch

from opcases import TOLERANCE, assert_matches_reference, relative_error
from test_local_attention import NAMES, blocks, forward_backward, make_inputs, reference, sliding
from timm_flashwin import block_sliding_window_attention, sliding_window_attention
from timm_flashwin.kernels.local import launch as local_launch
from timm_flashwin.ops.local_operators import local_attention_fwd
from timm_flashwin.ops.local_reference import block_window_visible, sliding_window_visible


def _compare_on_gpu(fn, visible, shape, dtype, chunk=None, scale=None):
    q, k, v, do = make_inputs(*shape, dtype=dtype, device="cuda")
    results = forward_backward(fn, q, k, v, do)
    expected = reference(visible, q, k, v, do, scale=scale, chunk=chunk)
    assert_matches_reference(results, expected, TOLERANCE[dtype], names=NAMES)


@pytest.mark.cuda
@pytest.mark.parametrize("fn,visible,shape", [
    pytest.param(sliding((512, 512)), sliding_window_visible(512, 512), (1, 4, 2, 16384, 128), id="window-512-S16k"),
    pytest.param(sliding((250, 249)), sliding_window_visible(250, 249), (2, 4, 4, 8192, 64), id="sliding500"),
    pytest.param(sliding((None, None), True), sliding_window_visible(None, 0), (1, 2, 2, 8192, 64), id="causal-8k"),
    pytest.param(sliding((None, None)), sliding_window_visible(None, None), (1, 2, 2, 16384, 128),
                 id="global-d128-S16k"),
    pytest.param(blocks(256, 4, 64), block_window_visible(256, 4, 64), (1, 12, 12, 32768, 64),
                 id="frames-256-4-sink64-S32k"),
    pytest.param(blocks(1560, 2), block_window_visible(1560, 2), (1, 4, 1, 12000, 128), id="frames-1560-mqa"),
    pytest.param(sliding((1024, 0)), sliding_window_visible(1024, 0), (1, 1, 1, 131072, 64), id="causal-1024-S128k"),
    # 4096 programs of 128 query rows: the forward's tall tiles on an H100 (local_plan.tall_tiles)
    pytest.param(sliding((512, 511)), sliding_window_visible(512, 511), (4, 16, 4, 8192, 64), id="window-1024-tall"),
    pytest.param(sliding((None, None), True), sliding_window_visible(None, 0), (8, 16, 16, 4096, 64),
                 id="causal-B8-tall"),
    # fewer queries than keys (the last at the last key: a decoder's new tokens), and more
    pytest.param(sliding((None, None), True), sliding_window_visible(None, 0), (1, 4, 2, (2048, 16384), 128),
                 id="causal-Sq2k-Sk16k"),
    pytest.param(blocks(256, 4, 64), block_window_visible(256, 4, 64), (1, 4, 4, (8192, 6000), 64),
                 id="frames-Sq8k-Sk6k"),
])
def test_gpu_long_sequences(fn, visible, shape):
    """Against the float64 reference computed a chunk of queries at a time (O(S * window))."""
    _compare_on_gpu(fn, visible, shape, torch.bfloat16, chunk=512)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [8, 40, 64, 96, 128, 256])
def test_gpu_head_dims_and_dtypes(head_dim, dtype):
    _compare_on_gpu(sliding((300, 100)), sliding_window_visible(300, 100), (2, 4, 2, 2000, head_dim), dtype)
    _compare_on_gpu(blocks(250, 3, 16, scale=0.2), block_window_visible(250, 3, 16), (1, 4, 4, 1999, head_dim),
                    dtype, scale=0.2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_dropout(dtype):
    shape = (1, 4, 2, 1000, 64)
    q, k, v, do = make_inputs(*shape, dtype=dtype, device="cuda")
    fn = sliding((100, 100), dropout_p=0.2)
    torch.manual_seed(3)
    state = torch.cuda.get_rng_state()
    ours = forward_backward(fn, q, k, v, do)
    torch.cuda.set_rng_state(state)
    seed = torch.randint(0, 2 ** 62, (1,), device="cuda", dtype=torch.int64)
    factor = local_launch.dropout_factors(seed, 1, 4, 1000, 0.2)
    expected = reference(sliding_window_visible(100, 100), q, k, v, do, dropout_factor=factor)
    assert_matches_reference(ours, expected, TOLERANCE[dtype], names=NAMES)


@pytest.mark.cuda
def test_gpu_torch_compile_fullgraph():
    """Inductor with both operators inside one graph: forward and gradients as in eager."""
    torch._dynamo.reset()
    q, k, v, do = make_inputs(2, 8, 2, 3000, 64, dtype=torch.bfloat16, device="cuda")

    def model(q, k, v):
        a = sliding_window_attention(q * 1.5, k, v, window=(256, 0), causal=True)
        b = block_sliding_window_attention(q, k, v, block_size=300, window_blocks=2, sink_tokens=8)
        return torch.nn.functional.gelu(a + b)

    compiled = torch.compile(model, fullgraph=True)
    for got, want in zip(forward_backward(compiled, q, k, v, do), forward_backward(model, q, k, v, do)):
        assert relative_error(got, want) < 1e-2


def _compiled_variants() -> int:
    from timm_flashwin.kernels.local import backward as local_backward, forward as local_forward
    total = 0
    for kernel in (local_forward.local_attention_fwd_kernel, local_backward.local_attention_bwd_dkdv_kernel,
                   local_backward.local_attention_bwd_dq_kernel):
        caches = getattr(kernel, "device_caches", None)
        total += (sum(len(entry[0]) for entry in caches.values()) if caches is not None
                  else sum(len(c) for c in kernel.cache.values()))
    return total


@pytest.mark.cuda
def test_gpu_no_recompile_for_new_lengths_windows_batches_or_scales():
    """A build per kind of pattern (sliding or blocks), sink or not, dropout or not: none for
    new lengths, batches, windows, block sizes, sink sizes or scales."""
    def step(B, S, window, scale):
        q, k, v, do = make_inputs(B, 4, 2, S, 64, dtype=torch.bfloat16, device="cuda")
        forward_backward(sliding(window, scale=scale), q, k, v, do)
        forward_backward(blocks(window[0] + 1, 3, window[1] + 1, scale=scale), q, k, v, do)

    step(1, 1024, (64, 64), None)
    torch.cuda.synchronize()
    before = _compiled_variants()
    for B, S, window, scale in [(2, 2048, (100, 3), 0.1), (3, 4096, (15, 0), 0.3), (1, 1536, (255, 32), 1.0)]:
        step(B, S, window, scale)
    torch.cuda.synchronize()
    assert _compiled_variants() == before


@pytest.mark.cuda
def test_gpu_memory_is_linear_in_the_sequence():
    """The published block sliding-window kernel's shape at S = 65536: the forward + backward's peak within 1.1x of the
    inputs, output, output gradient and gradients themselves."""
    B, H, S, D = 1, 12, 65536, 64
    q, k, v, do = make_inputs(B, H, H, S, D, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    others = torch.cuda.memory_allocated() - 4 * q.numel() * q.element_size()  # all but q, k, v, do
    out = block_sliding_window_attention(q, k, v, block_size=256, window_blocks=16)
    out.backward(do)
    torch.cuda.synchronize()
    tensors = 8 * q.numel() * q.element_size()  # q, k, v, do, out, dq, dk, dv
    assert torch.cuda.max_memory_allocated() - others <= 1.1 * tensors


@pytest.mark.cuda
def test_gpu_opcheck():
    q, k, v, _ = make_inputs(1, 4, 2, 300, 64, dtype=torch.bfloat16, device="cuda")
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 64, 128, 64, 16, 0.125, 0.0, None)
    torch.library.opcheck(local_attention_fwd, args)
    seed = torch.tensor([1234], dtype=torch.int64, device="cuda")
    torch.library.opcheck(local_attention_fwd, args[:-2] + (0.1, seed))
