"""The feature-map layout: ``WindowGrid`` against timm's roll and window partition, and
``window_attention(..., grid=)`` (the kernels reading and writing the unpartitioned map)
against the float64 reference of the partitioned op, forward and every gradient."""
from dataclasses import replace

import pytest
import torch
from timm.models.maxxvit import grid_partition, grid_reverse
from timm.models.swin_transformer import window_partition

from conftest import KERNEL_DEVICE
from opcases import (LOGIT_SCALES, TOLERANCE, Case, Reference, assert_matches_reference, bias_as_read,
                     forward_backward, gradient_conditions, shift_mask)
from timm_flashwin import window_attention
from timm_flashwin.kernels.window.plan import call_plan
from timm_flashwin.ops.reference import window_attention_reference
from timm_flashwin.ops.window_grid import WindowGrid
from window_calls import window_call

#: (height, width, window, shift): non-square windows and maps, shifts along one or both
#: axes, none; the last is swin_tiny's last-but-one stage (49 tokens, 2 x 1 windows)
GRIDS = [WindowGrid(4, 6, (2, 3), (1, 1)), WindowGrid(6, 4, (3, 2), (0, 1)), WindowGrid(4, 4, (2, 2)),
         WindowGrid(14, 7, (7, 7), (3, 3))]
#: MaxViT's grid windows (timm's grid_partition): 2 x 3 windows of 3 x 2 tokens strided over a
#: 6 x 6 map, 4 x 2 windows of 2 x 3 over 8 x 6
STRIDED_GRIDS = [WindowGrid(6, 6, (3, 2), strided=True), WindowGrid(8, 6, (2, 3), strided=True)]


def _grid_id(grid: WindowGrid) -> str:
    return (f"{grid.height}x{grid.width}-w{grid.window[0]}x{grid.window[1]}-"
            + ("strided" if grid.strided else f"s{grid.shift[0]}{grid.shift[1]}"))


@pytest.mark.parametrize("grid", GRIDS, ids=_grid_id)
def test_partition_is_timms_roll_and_window_partition(grid):
    batch, channels = 2, 5
    x = torch.randn(batch, grid.height, grid.width, channels)
    shifted = torch.roll(x, shifts=(-grid.shift[0], -grid.shift[1]), dims=(1, 2))
    timm_windows = window_partition(shifted, grid.window).reshape(-1, grid.tokens, channels)
    flat = x.reshape(batch, -1, channels)
    assert torch.equal(grid.partition(flat), timm_windows)
    assert torch.equal(grid.merge(timm_windows), flat)  # timm's merge and roll back give the map again
    token_map = grid.token_map(x.device)
    assert token_map.dtype == torch.int32 and token_map.shape == (grid.num_windows, grid.tokens)
    assert torch.equal(token_map.view(-1).sort().values, torch.arange(grid.height * grid.width, dtype=torch.int32))


@pytest.mark.parametrize("grid", STRIDED_GRIDS, ids=_grid_id)
def test_strided_partition_is_timms_grid_partition(grid):
    batch, channels = 2, 5
    x = torch.randn(batch, grid.height, grid.width, channels)
    timm_windows = grid_partition(x, list(grid.window)).reshape(-1, grid.tokens, channels)
    flat = x.reshape(batch, -1, channels)
    assert torch.equal(grid.partition(flat), timm_windows)
    reversed_map = grid_reverse(timm_windows.view(-1, *grid.window, channels), list(grid.window),
                                [grid.height, grid.width])
    assert torch.equal(grid.merge(timm_windows), reversed_map.reshape(batch, -1, channels))


@pytest.mark.parametrize("kwargs, message", [
    (dict(height=5, width=4, window=(2, 2)), "multiple of `window`"),
    (dict(height=4, width=4, window=(2, 2), shift=(2, 0)), "`shift` must be below"),
    (dict(height=4, width=4, window=(2,)), "`window` must be a pair"),
    (dict(height=4, width=4, window=(2, 2), shift=(-1, 0)), "`shift` must be a pair of ints >= 0"),
    (dict(height=0, width=4, window=(2, 2)), "`height` must be a positive int"),
    (dict(height=4, width=4, window=(2, 2), shift=(1, 0), strided=True), "strided .* no shift"),
])
def test_bad_grids_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WindowGrid(**kwargs)


def _map_case(grid: WindowGrid, *, heads: int, head_dim: int, cosine: bool, masked: bool, dtype: torch.dtype,
              batch: int = 2, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    rows, n = grid.height * grid.width, grid.tokens
    qkv = torch.randn(batch, rows, 3 * heads * head_dim, generator=g).to(dtype)
    bias = 2 * torch.randn(heads, n, n, generator=g)
    mask = shift_mask(grid.num_windows, n, g) if masked else None
    logit_scale = torch.tensor(LOGIT_SCALES[:heads]) if cosine else None  # below and above the clamp
    grad_out = torch.randn(batch, rows, heads * head_dim, generator=g).to(dtype)
    move = lambda t: None if t is None else t.to(KERNEL_DEVICE)  # noqa: E731
    return Case(move(qkv), heads, move(bias), move(mask), None if cosine else head_dim ** -0.5, move(logit_scale),
                move(grad_out))


def _on_the_map(grid: WindowGrid):
    return lambda qkv, heads, **kwargs: window_attention(qkv, heads, grid=grid, **kwargs)


def _reference_on_windows(grid: WindowGrid):
    return lambda qkv, heads, **kwargs: grid.merge(window_attention_reference(grid.partition(qkv), heads, **kwargs))


def _reference(grid: WindowGrid, case: Case) -> Reference:
    """The float64 reference on the map's windows, with the gradients' conditions."""
    windows = replace(case, qkv=grid.partition(case.qkv), grad_out=grid.partition(case.grad_out))
    return Reference(forward_backward(_reference_on_windows(grid), case, torch.float64), gradient_conditions(windows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
@pytest.mark.parametrize("grid", GRIDS + STRIDED_GRIDS[:1], ids=_grid_id)
def test_feature_map_layout_matches_float64_reference(grid, cosine, masked, dtype, monkeypatch):
    case = _map_case(grid, heads=2, head_dim=8, cosine=cosine, masked=masked, dtype=dtype, seed=1)
    reference = _reference(grid, case)
    refuse = lambda self, x: pytest.fail("the op partitioned the map")  # noqa: E731
    monkeypatch.setattr(WindowGrid, "partition", refuse)
    assert_matches_reference(forward_backward(_on_the_map(grid), case), reference, TOLERANCE[dtype])


@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_feature_map_layout_is_the_partitioned_op_bit_for_bit_with_dropout(cosine):
    """Same seed, same kernels, other addresses: the same dropout mask (drawn by window
    index, which both layouts share) and the same numbers, forward and backward."""
    grid = GRIDS[0]
    case = _map_case(grid, heads=2, head_dim=8, cosine=cosine, masked=True, dtype=torch.float32)

    def run(fn):
        torch.manual_seed(7)
        return forward_backward(lambda qkv, heads, **kw: fn(qkv, heads, dropout_p=0.4, **kw), case)

    on_map = run(_on_the_map(grid))
    on_windows = run(lambda qkv, heads, **kw: grid.merge(window_attention(grid.partition(qkv), heads, **kw)))
    for ours, theirs in zip(on_map, on_windows):
        assert torch.equal(ours, theirs)


def test_windows_whose_backward_streams_blocks_are_partitioned_in_training_only(monkeypatch):
    """The kernels that stream key blocks read partitioned windows: in training such windows
    go through grid.partition and merge; without a gradient the forward reads the map."""
    grid = WindowGrid(12, 12, (12, 12), (5, 5))  # 144 tokens: the multi-block backward
    case = _map_case(grid, heads=1, head_dim=8, cosine=True, masked=True, dtype=torch.float32, batch=1)
    call = call_plan(window_call(144, 8, torch.float32, True))
    assert call.maps_windows(backward=False) and not call.maps_windows(backward=True)
    reference = _reference(grid, case)
    assert_matches_reference(forward_backward(_on_the_map(grid), case), reference, TOLERANCE[torch.float32])
    monkeypatch.setattr(WindowGrid, "partition", lambda self, x: pytest.fail("partitioned without a gradient"))
    with torch.no_grad():
        out = window_attention(case.qkv, 1, grid=grid, **case.kwargs())
    assert_matches_reference([out], reference[:1], TOLERANCE[torch.float32])


def test_pytorch_path_partitions_the_map():
    """float64 (and CPU without the interpreter) run PyTorch's math on the partitioned
    windows, with the same result."""
    grid = GRIDS[0]
    case = _map_case(grid, heads=2, head_dim=8, cosine=False, masked=True, dtype=torch.float64)
    ours = forward_backward(_on_the_map(grid), case)
    for actual, expected in zip(ours, forward_backward(_reference_on_windows(grid), case)):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_bad_feature_map_inputs_name_the_argument():
    grid = GRIDS[0]
    qkv = torch.randn(2, grid.height * grid.width + 1, 48, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"`qkv` must be of shape \(B, H\*W, 3\*H\*D\) with H\*W = 4\*6"):
        window_attention(qkv, 2, scale=0.5, grid=grid)
    with pytest.raises(TypeError, match="`grid` must be a WindowGrid"):
        window_attention(qkv, 2, scale=0.5, grid=(4, 6))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
@pytest.mark.parametrize("grid", [WindowGrid(56, 56, (7, 7), (3, 3)), WindowGrid(32, 32, (8, 8), (4, 4)),
                                  WindowGrid(24, 24, (12, 12), (6, 6))], ids=_grid_id)
def test_gpu_feature_map_layout_at_model_shapes(grid, cosine, dtype, deterministic_algorithms):
    """swin_tiny's and SwinV2-tiny's first stages (one-tile windows: read in place, forward
    and backward) and a window of 144 tokens (forward in place; in training partitioned):
    bit for bit the partitioned op, within the tolerance of float64. In deterministic mode:
    elsewhere the multi-block backward adds with atomics, in an order that varies."""
    case = _map_case(grid, heads=3, head_dim=32, cosine=cosine, masked=True, dtype=dtype, batch=4)
    on_map = forward_backward(_on_the_map(grid), case)
    on_windows = forward_backward(
        lambda qkv, heads, **kw: grid.merge(window_attention(grid.partition(qkv), heads, **kw)), case)
    for ours, theirs in zip(on_map, on_windows):
        assert torch.equal(ours, theirs)
    # the bias as the kernels read it (a float16 copy where they stream key blocks), for the window's N
    windows = replace(case, qkv=grid.partition(case.qkv), grad_out=grid.partition(case.grad_out))
    reference = _reference(grid, replace(case, bias=bias_as_read(windows).bias))
    assert_matches_reference(on_map, reference, TOLERANCE[dtype])


def test_partition_and_merge_gradients_are_gathers(deterministic_algorithms):
    """The gradient of partition is merge and that of merge is partition, exactly (no
    index_add_ scatter: deterministic mode allows them on every device)."""
    grid = GRIDS[0]
    x = torch.randn(2, grid.height * grid.width, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2 * grid.num_windows, grid.tokens, 5, dtype=torch.float64)
    grid.partition(x).backward(g)
    assert torch.equal(x.grad, grid.merge(g))
    w = g.clone().requires_grad_()
    grid.merge(w).backward(x.detach())
    assert torch.equal(w.grad, grid.partition(x.detach()))
    assert torch.autograd.gradcheck(lambda t: grid.merge(grid.partition(t) * 2.0), (x,))


def test_maps_made_under_inference_mode_serve_training():
    """A grid first used under torch.inference_mode (a model's first call) keeps its maps for
    later calls; a training call's partition saves one for its backward, which an inference
    tensor cannot be."""
    grid = WindowGrid(6, 4, (3, 2), (1, 1))  # used by no other test: its maps are made here
    x = torch.randn(2, grid.height * grid.width, 5)
    with torch.inference_mode():
        expected = grid.partition(x)
    w = x.clone().requires_grad_()
    windows = grid.partition(w)
    assert torch.equal(windows, expected)
    windows.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(x))


def test_compiled_partition_and_merge_take_their_maps_as_constants():
    """Under torch.compile the grid's maps are constants of the graph (computed when it is
    traced): no argsort or index arithmetic per step; values and gradients equal eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    grid = GRIDS[0]
    targets = []

    def backend(gm, example_inputs):  # keeps the dynamo graph's calls, then runs it through aot_autograd
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    def step(t: torch.Tensor) -> torch.Tensor:
        return grid.merge(grid.partition(t) * 2.0)

    x = torch.randn(2, grid.height * grid.width, 5, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(step, backend=backend, fullgraph=True)(x)
    out.backward(torch.ones_like(out))
    assert torch.equal(out, step(x)) and torch.equal(x.grad, torch.full_like(x, 2.0))
    assert targets and not any("sort" in t or "arange" in t for t in targets), targets
