"""window_attention(..., bias=TableBias(table, index)): the relative-position bias given by
its table, gathered within the op (interpreter on CPU in CI) against float64, against the
op given the gathered bias, and the one autograd node it takes in eager mode."""
from dataclasses import replace

import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import TOLERANCE, Reference, assert_matches_reference, gradient_conditions, kernels_launched, make_case
from test_position_bias import relative_position_index
from timm_flashwin import TableBias, WindowGrid, window_attention
from timm_flashwin.ops.position_bias import gather_position_bias
from timm_flashwin.ops.reference import window_attention_reference


def _table_case(window, heads, *, cosine, dtype, windows=4, head_dim=16, seed=0):
    """(case, table (T, H) float32, index (N, N)): an op case whose bias is ``table[index]``."""
    n = window[0] * window[1]
    case = make_case(windows, 2, heads, n, head_dim, cosine=cosine, masked=True, dtype=dtype, device=KERNEL_DEVICE,
                     seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    table = torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads, generator=g).to(KERNEL_DEVICE)
    return case, table, relative_position_index(*window).to(KERNEL_DEVICE)


def _run(case, table, index, sigmoid_scale, *, as_table: bool, grid=None, dtype=None):
    """[out, d qkv, d table, (d logit_scale)] of the op with the bias given as a TableBias
    or gathered beforehand (``gather_position_bias``); with ``grid``, on the feature map
    whose windows are the case's (results partitioned again); ``dtype`` float64: the
    reference (PyTorch, on the windows)."""
    reference = dtype == torch.float64
    qkv = case.qkv.detach().to(dtype or case.qkv.dtype)
    grad_out = case.grad_out.to(qkv.dtype)
    on_map = grid is not None and not reference
    if on_map:
        qkv, grad_out = grid.merge(qkv), grid.merge(grad_out)
    qkv.requires_grad_()
    table = table.detach().to(dtype or table.dtype).requires_grad_()
    logit_scale = None if case.logit_scale is None else case.logit_scale.detach().to(dtype or torch.float32)
    if logit_scale is not None:
        logit_scale.requires_grad_()
    if reference:
        dense = table[index.view(-1)].view(*index.shape, -1).permute(2, 0, 1)
        bias = sigmoid_scale * torch.sigmoid(dense) if sigmoid_scale else dense
        # the values the kernels read (the sigmoid's in float32), the gradient of the exact ones:
        # the logit-scale gradient, a sum whose terms cancel, moves with the bias's rounding
        as_read = gather_position_bias(table.detach().float(), index, sigmoid_scale=sigmoid_scale).double()
        bias = bias + (as_read - bias).detach()
        attention = window_attention_reference
    else:
        bias = (TableBias(table, index, sigmoid_scale) if as_table
                else gather_position_bias(table, index, sigmoid_scale=sigmoid_scale))
        attention = window_attention
    out = attention(qkv, case.num_heads, bias=bias, mask=case.mask.to(dtype or case.mask.dtype), scale=case.scale,
                    logit_scale=logit_scale, **(dict(grid=grid) if on_map else {}))
    out.backward(grad_out)
    results = [out.detach(), qkv.grad]
    if on_map:
        results = [grid.partition(r) for r in results]
    results += [table.grad] + ([logit_scale.grad] if logit_scale is not None else [])
    if not reference:
        return results
    return Reference(results, gradient_conditions(replace(case, qkv=qkv, bias=bias.detach(), mask=case.mask.double(),
                                                          logit_scale=logit_scale, grad_out=grad_out)))


# V1 (the bias gathered as it is) and SwinV2 (cosine, 16 * sigmoid of it), as timm pairs them
FAMILIES = [pytest.param(False, None, id="v1"), pytest.param(True, 16.0, id="swinv2")]
#: the position-bias gather's kernel, which the attention kernels of one-tile windows spare
GATHER = "relative_bias_gather_kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cosine, sigmoid_scale", FAMILIES)
@pytest.mark.parametrize("window, grid", [
    ((4, 4), None), ((4, 4), WindowGrid(8, 4, (4, 4), (2, 0))),
    ((5, 3), None), ((5, 3), WindowGrid(5, 6, (5, 3), (0, 1))),  # 15 tokens: padded tiles
], ids=["4x4-windows", "4x4-feature-map", "5x3-windows", "5x3-feature-map"])
def test_one_tile_windows_match_float64_and_the_gathered_bias(window, grid, cosine, sigmoid_scale, dtype):
    """Windows of one tile, whose kernels read the table themselves (no gather launched):
    output and every gradient within the tolerance of float64, and bit for bit those of the
    op given the gathered bias (the kernels build the same bias tile)."""
    case, table, index = _table_case(window, 2, cosine=cosine, dtype=dtype)
    with kernels_launched() as launched:
        ours = _run(case, table, index, sigmoid_scale, as_table=True, grid=grid)
    assert GATHER not in launched and "relative_bias_table_grad_kernel" in launched  # the table's gradient summed
    gathered = _run(case, table, index, sigmoid_scale, as_table=False, grid=grid)
    reference = _run(case, table, index, sigmoid_scale, as_table=False, dtype=torch.float64)
    names = ("out", "d_qkv", "d_table", "d_logit_scale")
    assert_matches_reference(ours, reference, TOLERANCE[dtype], names)
    for a, b in zip(ours, gathered):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cosine, sigmoid_scale", FAMILIES)
def test_windows_of_several_blocks_match_float64(cosine, sigmoid_scale):
    """Windows of 9 x 9 (81 tokens): the kernels stream key blocks and read the bias gathered
    (within the op's node), the bias gradient from the multi-block kernels."""
    case, table, index = _table_case((9, 9), 1, cosine=cosine, dtype=torch.float32, windows=2)
    with kernels_launched() as launched:
        ours = _run(case, table, index, sigmoid_scale, as_table=True)
    assert launched.count(GATHER) == 1
    reference = _run(case, table, index, sigmoid_scale, as_table=False, dtype=torch.float64)
    assert_matches_reference(ours, reference, TOLERANCE[torch.float32], ("out", "d_qkv", "d_table", "d_logit_scale"))


def test_eager_training_takes_one_autograd_node_and_no_gather_of_its_own():
    case, table, index = _table_case((4, 4), 2, cosine=False, dtype=torch.float32)
    table.requires_grad_()
    out = window_attention(case.qkv.requires_grad_(), 2, bias=TableBias(table, index), mask=case.mask,
                           scale=case.scale)
    node = out.grad_fn
    while "EagerWindowAttention" not in type(node).__name__:  # the [0] of the op's outputs
        node = node.next_functions[0][0]
    inputs = [fn for fn, _ in node.next_functions if fn is not None]
    # straight into the table's gradient accumulator: no gather node between
    assert any(type(fn).__name__ == "AccumulateGrad" and fn.variable is table for fn in inputs)


def test_inference_gives_the_gathered_bias_output():
    case, table, index = _table_case((4, 4), 2, cosine=True, dtype=torch.bfloat16)
    with torch.no_grad():
        ours = window_attention(case.qkv, 2, bias=TableBias(table, index, 16.0), mask=case.mask,
                                logit_scale=case.logit_scale)
        gathered = window_attention(case.qkv, 2, bias=gather_position_bias(table, index, sigmoid_scale=16.0),
                                    mask=case.mask, logit_scale=case.logit_scale)
    assert torch.equal(ours, gathered)


@pytest.mark.parametrize("cosine, sigmoid_scale", FAMILIES)
@pytest.mark.parametrize("window", [(4, 4), (9, 9)], ids=["one-tile", "several-blocks"])
def test_the_registered_operators_read_the_table(window, cosine, sigmoid_scale, monkeypatch,
                                                 deterministic_algorithms):
    """Where the op cannot skip the dispatch (torch.compile, dispatch modes, subclasses) it
    runs the registered operators; their kernels read the table through the index (its own
    int64, not the eager path's int32 copy) where windows are one tile, with no gather, and
    sum the table's gradient in the backward operator; larger windows take the gathered
    bias (``TableBias.dense()``). Bit for bit the eager path's results (in deterministic
    mode: on a GPU the larger windows' backward otherwise sums the logit scale's gradient
    with atomic adds, in a varying order)."""
    from timm_flashwin.ops import window as op, position_bias
    case, table, index = _table_case(window, 2, cosine=cosine, dtype=torch.float32, windows=2)
    assert index.dtype == torch.int64
    eager = _run(case, table, index, sigmoid_scale, as_table=True)
    for module in (op, position_bias):
        monkeypatch.setattr(module, "dispatch_free", lambda t: False)
    gathers = []
    real_gather = position_bias.gather_position_bias_op
    monkeypatch.setattr(position_bias, "gather_position_bias_op", lambda *a: gathers.append(1) or real_gather(*a))
    dispatched = _run(case, table, index, sigmoid_scale, as_table=True)
    assert len(gathers) == (0 if window == (4, 4) else 1)
    for a, b in zip(eager, dispatched):
        assert torch.equal(a, b)


def test_compiled_with_a_table_matches_eager():
    """torch.compile (fullgraph) of the op given a ``TableBias`` with a constant index, called
    on two window sizes: the table read by the operators, and the eager path's output and
    gradients. The second size recompiles with symbolic shapes (dynamo's automatic dynamic
    shapes): the table's rows are then sorted in the graph (taken for constants, they
    failed to trace)."""
    compiled = torch.compile(window_attention, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    try:
        for window in ((4, 4), (5, 3)):
            case, table, index = _table_case(window, 2, cosine=True, dtype=torch.float32, windows=2)
            results = []
            for attention in (window_attention, compiled):
                qkv, table_ = case.qkv.detach().requires_grad_(), table.detach().requires_grad_()
                out = attention(qkv, 2, bias=TableBias(table_, index, 16.0, constant_index=True), mask=case.mask,
                                logit_scale=case.logit_scale)
                out.backward(case.grad_out)
                results.append((out.detach(), qkv.grad, table_.grad))
            for eager, traced in zip(*results):
                torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-7)
    finally:
        torch._dynamo.reset()


def test_operator_check_with_a_table():
    """Schema, fake tensors (the table's gradient of the table's shape and dtype), autograd
    registration and AOT dispatch of the forward operator given a table and its index."""
    from timm_flashwin.ops.window_operators import window_attention_fwd
    from timm_flashwin.ops.position_bias import operator_table_rows
    case, table, index = _table_case((4, 4), 2, cosine=True, dtype=torch.float32, windows=2)
    args = (case.qkv.requires_grad_(), 2, table.requires_grad_(), case.mask, case.logit_scale.reshape(2), 1.0,
            True, 0.0, None, True, index, *operator_table_rows(index, table, False), 16.0)
    torch.library.opcheck(window_attention_fwd, args)


def test_pytorch_path_takes_the_gathered_bias():
    """float64 runs in PyTorch: the bias gathered with PyTorch's indexing, the gradient
    reaching the table through it."""
    case, table, index = _table_case((4, 4), 2, cosine=True, dtype=torch.float32)
    case = replace(case, qkv=case.qkv.double(), grad_out=case.grad_out.double(), mask=case.mask.double(),
                   logit_scale=case.logit_scale.double())
    ours = _run(case, table.double(), index, 16.0, as_table=True)
    gathered = _run(case, table.double(), index, 16.0, as_table=False)
    for a, b in zip(ours, gathered):
        assert torch.equal(a, b)
    assert ours[0].dtype == ours[2].dtype == torch.float64


def test_table_gradient_is_reproducible():
    """The table kernel sums each row's (slice, pair) terms in a fixed order."""
    case, table, index = _table_case((4, 4), 2, cosine=False, dtype=torch.bfloat16)
    first = _run(case, table, index, None, as_table=True)[2]
    assert torch.equal(first, _run(case, table, index, None, as_table=True)[2])


@pytest.mark.parametrize("bias, error, message", [
    (lambda t, i: TableBias(t[:, :1], i), ValueError, r"`bias.table` must be of shape \(T, H\) with H = num_heads = 2"),
    (lambda t, i: TableBias(t[0], i), ValueError, r"`bias.table` must be a tensor of rank 2"),
    (lambda t, i: TableBias(t.double(), i), TypeError, r"`bias.table` must be of dtype float32"),
    (lambda t, i: TableBias(t, i[:3]), ValueError, r"`bias.index` must be of shape \(N, N\) = \(16, 16\)"),
    (lambda t, i: TableBias(t, i.float()), TypeError, r"`bias.index` must be an integer torch.Tensor"),
    (lambda t, i: TableBias(t, i.clone().fill_(49)), ValueError,
     r"`bias.index` must hold table rows in \[0, 49\) \(the rows of `bias.table`\), got values in \[49, 49\]"),
    (lambda t, i: TableBias(t, i, 0.0), ValueError, r"`sigmoid_scale` must be None or a finite nonzero float"),
])
def test_bad_table_bias_names_the_argument(bias, error, message):
    case, table, index = _table_case((4, 4), 2, cosine=False, dtype=torch.float32)
    with pytest.raises(error, match=message):
        window_attention(case.qkv, 2, bias=bias(table.requires_grad_(), index), scale=case.scale)


@pytest.mark.parametrize("road", ["kernels", "pytorch"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_an_index_out_of_range_is_one_error_on_both_roads(road, grad):
    """-1 (which PyTorch's indexing wraps to the last row) and a row past the table's end are
    the same ValueError naming ``bias.index`` on the kernels' road and on PyTorch's (float64),
    with a gradient or without; a valid index after it (in place) is checked again."""
    case, table, index = _table_case((4, 4), 2, cosine=False, dtype=torch.float32)
    qkv = case.qkv.double() if road == "pytorch" else case.qkv
    table = table.to(qkv.dtype).requires_grad_(grad)
    for bad, values in ((-1, r"\[-1, 48\]"), (49, r"\[0, 49\]")):
        wrong = index.clone()
        wrong[0, 1] = bad
        with torch.set_grad_enabled(grad), pytest.raises(
                ValueError, match=rf"^window_attention: `bias.index` must hold table rows in \[0, 49\) \(the rows "
                                  rf"of `bias.table`\), got values in {values}$"):
            window_attention(qkv, 2, bias=TableBias(table, wrong), scale=case.scale)
        wrong[0, 1] = index[0, 1]  # fixed in place: checked again, and served
        window_attention(qkv, 2, bias=TableBias(table, wrong), scale=case.scale)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cosine, sigmoid_scale", FAMILIES)
@pytest.mark.parametrize("window, heads, windows, grid", [
    ((7, 7), 3, 128, WindowGrid(56, 56, (7, 7), (3, 3))),  # swin_tiny's stage 1, read in place
    ((8, 8), 3, 32, WindowGrid(32, 32, (8, 8), (4, 4))),  # SwinV2-tiny's
    ((12, 12), 4, 32, None),  # windows whose backward streams key blocks
    ((24, 24), 4, 8, None),
], ids=["w7-map", "w8-map", "w12", "w24"])
def test_gpu_model_shapes_match_the_gathered_bias(window, heads, windows, grid, cosine, sigmoid_scale, dtype,
                                                  deterministic_algorithms):
    """At model shapes, in deterministic mode (elsewhere the multi-block backward adds the
    bias gradient with atomics): the output and every gradient bit for bit the op's given
    the gathered bias; the one-tile windows within the tolerance of float64 too."""
    case, table, index = _table_case(window, heads, cosine=cosine, dtype=dtype, windows=windows, head_dim=32)
    ours = _run(case, table, index, sigmoid_scale, as_table=True, grid=grid)
    gathered = _run(case, table, index, sigmoid_scale, as_table=False, grid=grid)
    for a, b in zip(ours, gathered):
        assert torch.equal(a, b)
    if grid is not None:
        reference = _run(case, table, index, sigmoid_scale, as_table=False, dtype=torch.float64)
        assert_matches_reference(ours, reference, TOLERANCE[dtype], ("out", "d_qkv", "d_table", "d_logit_scale"))
