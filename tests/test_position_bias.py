"""gather_position_bias: timm's gather of the dense bias from its table, with the table
gradient summed by the kernel (interpreter on CPU in CI) against float64."""
import pytest
import torch

from conftest import KERNEL_DEVICE
from timm_flashwin.ops.position_bias import TableRows, gather_position_bias


def relative_position_index(win_h: int, win_w: int) -> torch.Tensor:
    """timm's relative_position_index (N, N) of a win_h x win_w window."""
    y, x = torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij")
    y, x = y.flatten(), x.flatten()
    return (y[:, None] - y[None, :] + win_h - 1) * (2 * win_w - 1) + (x[:, None] - x[None, :] + win_w - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window, heads", [((7, 7), 3), ((8, 8), 12), ((6, 7), 1), ((12, 12), 4), ((7, 7), 48)])
def test_matches_pytorch_forward_and_float64_table_gradient(window, heads, dtype):
    g = torch.Generator().manual_seed(heads)
    index = relative_position_index(*window).to(KERNEL_DEVICE)
    rows, n = (2 * window[0] - 1) * (2 * window[1] - 1), index.shape[0]
    table = torch.randn(rows, heads, generator=g).to(dtype).to(KERNEL_DEVICE).requires_grad_()
    grad = torch.randn(n, n, heads, generator=g).to(dtype).to(KERNEL_DEVICE).permute(2, 0, 1)  # not contiguous
    bias = gather_position_bias(table, index)
    assert bias.shape == (heads, n, n) and bias.is_contiguous()
    torch.testing.assert_close(bias, table[index.view(-1)].view(n, n, -1).permute(2, 0, 1), rtol=0, atol=0)
    bias.backward(grad)
    expected = torch.zeros(rows, heads, dtype=torch.float64).index_add_(
        0, index.view(-1).cpu(), grad.permute(1, 2, 0).reshape(n * n, heads).double().cpu())
    assert table.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(table.grad.double().cpu(), expected, rtol=tol, atol=tol)


def test_rows_are_sorted_once_per_index_and_again_after_an_in_place_change():
    index = relative_position_index(7, 7).to(KERNEL_DEVICE)
    first = TableRows.of(index, 169)
    assert TableRows.of(index, 169) is first
    index.copy_(index.flip(0))  # a new version
    again = TableRows.of(index, 169)
    assert again is not first
    assert torch.equal(first.offsets, again.offsets) and not torch.equal(first.order, again.order)


def test_gradient_is_reproducible_and_nan_reaches_only_its_row():
    index = relative_position_index(7, 7).to(KERNEL_DEVICE)
    table = torch.randn(169, 3).to(KERNEL_DEVICE).requires_grad_()
    grad = torch.randn(3, 49, 49).to(KERNEL_DEVICE)
    grads = []
    for _ in range(2):
        table.grad = None
        gather_position_bias(table, index).backward(grad)
        grads.append(table.grad.clone())
    assert torch.equal(grads[0], grads[1])
    grad[1, 0, 5] = float("nan")
    table.grad = None
    gather_position_bias(table, index).backward(grad)
    nan_rows, nan_heads = torch.nonzero(table.grad.isnan(), as_tuple=True)
    assert nan_rows.tolist() == [index[0, 5].item()] and nan_heads.tolist() == [1]


@pytest.mark.parametrize("index, table, message", [
    (torch.zeros(4, 5, dtype=torch.long), torch.zeros(9, 2), "`index` must be of shape (N, N)"),
    (torch.zeros(4, 4, dtype=torch.long), torch.zeros(9), "`table` must be of shape (rows, heads)"),
    (torch.full((4, 4), 9, dtype=torch.long), torch.zeros(9, 2), "`index` must hold table rows in [0, 9)"),
])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "no-grad"])
def test_bad_input_names_the_argument(index, table, message, requires_grad):
    table = table.to(KERNEL_DEVICE).requires_grad_(requires_grad)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        gather_position_bias(table, index.to(KERNEL_DEVICE))


@pytest.mark.parametrize("window", [(7, 7), (24, 24)])
def test_gather_without_gradient_runs_the_kernel(window, monkeypatch):
    """Without a gradient (no_grad, or a table that takes none) the eager gather runs the
    same kernel (PyTorch's indexing took 50 times as long on 24x24 windows on an H200),
    bit-equal to PyTorch's gather."""
    from timm_flashwin.ops import position_bias
    calls = []
    real = position_bias.relative_bias_gather
    monkeypatch.setattr(position_bias, "relative_bias_gather", lambda *a: calls.append(1) or real(*a))
    index = relative_position_index(*window).to(KERNEL_DEVICE)
    n = index.shape[0]
    table = torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), 4).to(KERNEL_DEVICE)
    expected = table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)
    for requires_grad in (False, True):
        with torch.no_grad():
            bias = gather_position_bias(table.requires_grad_(requires_grad), index)
        assert bias.is_contiguous() and not bias.requires_grad
        torch.testing.assert_close(bias, expected, rtol=0, atol=0)
    assert len(calls) == 2


def test_compiled_gather_takes_the_registered_operators():
    """Under torch.compile (one graph, no break) the gather and its table gradient are the
    registered operators, the pairs sorted in the graph: same bias and table gradient as
    the eager path."""
    index = relative_position_index(7, 7).to(KERNEL_DEVICE)
    grad = torch.randn(3, 49, 49).to(KERNEL_DEVICE)
    results = []
    for fn in (gather_position_bias, torch.compile(gather_position_bias, backend="aot_eager", fullgraph=True)):
        table = torch.randn(169, 3, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE).requires_grad_()
        bias = fn(table, index)
        bias.backward(grad)
        results.append((bias.detach(), table.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("as_parameter", [False, True], ids=["tensor", "parameter"])
def test_eager_gather_skips_the_operator_dispatch(as_parameter, monkeypatch):
    """In eager mode the gather of a table that takes a gradient runs its kernels through
    an autograd.Function, not the registered operators, also where the table is an
    nn.Parameter (as timm's relative_position_bias_table is): same bias and gradient."""
    from timm_flashwin.ops import position_bias
    index = relative_position_index(7, 7).to(KERNEL_DEVICE)
    grad = torch.randn(3, 49, 49).to(KERNEL_DEVICE)
    values = torch.randn(169, 3, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    ops_called = []
    real_op = position_bias.gather_position_bias_op
    monkeypatch.setattr(position_bias, "gather_position_bias_op", lambda *a: ops_called.append(1) or real_op(*a))
    results = []
    for dispatched in (False, True):
        if dispatched:
            monkeypatch.setattr(position_bias, "dispatch_free", lambda t: False)
        table = torch.nn.Parameter(values.clone()) if as_parameter else values.clone().requires_grad_()
        bias = gather_position_bias(table, index)
        assert bool(ops_called) == dispatched
        bias.backward(grad)
        results.append((bias.detach(), table.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)


def test_table_gradient_of_pairs_sorted_from_another_index_is_nan():
    """The table-gradient kernel, given the index, checks every pair it sums: pairs sorted
    from another index of the same shape (what a compiled graph would hold if a module's
    index changed after tracing) make the rows they no longer match NaN, never a wrong
    number; pairs of the index itself give the float64 sums."""
    from timm_flashwin.kernels.position.launch import relative_bias_table_grad
    from timm_flashwin.ops.position_bias import _sorted_pairs
    index = relative_position_index(7, 7).to(KERNEL_DEVICE)
    grad = torch.randn(3, 49, 49, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    expected = torch.zeros(169, 3, dtype=torch.float64).index_add_(
        0, index.view(-1).cpu(), grad.permute(1, 2, 0).reshape(-1, 3).double().cpu())
    good = relative_bias_table_grad(grad, *_sorted_pairs(index, 169), 169, torch.float32, index=index)
    torch.testing.assert_close(good.double().cpu(), expected, rtol=1e-5, atol=1e-5)
    other = index.flip(1)  # the same rows, other pairs
    stale = relative_bias_table_grad(grad, *_sorted_pairs(other, 169), 169, torch.float32, index=index).cpu()
    nan_rows = stale.isnan().any(1)
    assert nan_rows.any() and bool(stale.isnan().all(1)[nan_rows].all())
    mismatched = {int(t) for t in torch.unique(other.view(-1)[index.view(-1) != other.view(-1)].cpu())}
    assert set(torch.nonzero(nan_rows).view(-1).tolist()) == mismatched
    torch.testing.assert_close(stale[~nan_rows].double(), expected[~nan_rows], rtol=1e-5, atol=1e-5)


class _TableModule(torch.nn.Module):
    """A table parameter and an index buffer, as timm's V1 attention holds them."""

    def __init__(self, constant_index: bool):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(169, 3, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("index", relative_position_index(7, 7), persistent=False)
        self.constant_index = constant_index

    def forward(self):
        return gather_position_bias(self.table, self.index, constant_index=self.constant_index)


@pytest.mark.parametrize("constant_index", [True, False], ids=["constant-index", "index-sorted-in-graph"])
def test_compiled_gather_sorts_a_constant_index_once(constant_index):
    """Under torch.compile a module's index with ``constant_index`` (as the adapters pass
    timm's relative_position_index) has its pairs sorted when the graph is traced: the
    graph holds no sort; without it the graph sorts them at every call. Either way the
    bias and the table gradient equal the eager path's. Changed in place after tracing,
    the constant index gives NaN rows in the table gradient, not wrong numbers."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    grad = torch.randn(3, 49, 49, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    eager, module = (_TableModule(constant_index).to(KERNEL_DEVICE) for _ in range(2))
    targets = []

    def backend(gm, example_inputs):  # keeps the dynamo graph's calls, then runs it through aot_autograd
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    eager().backward(grad)
    compiled().backward(grad)
    torch.testing.assert_close(compiled().detach(), eager().detach(), rtol=0, atol=0)
    torch.testing.assert_close(module.table.grad, eager.table.grad, rtol=0, atol=0)
    assert any("sort" in t for t in targets) != constant_index
    module.index.copy_(module.index.flip(1))  # in place: the compiled graph is not traced again
    module.table.grad = None
    compiled().backward(grad)
    assert bool(module.table.grad.isnan().any()) == constant_index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dispatched", [False, True], ids=["eager", "operators"])
def test_sigmoid_scale_matches_float64(dtype, dispatched, monkeypatch):
    """SwinV2's bias, 16 * sigmoid(table[index]), with the sigmoid in the gather kernel and
    its derivative applied per table row in the gradient kernel (the autograd.Function and
    the registered operators): against float64 autograd of timm's expression, NaN staying
    in its row."""
    from timm_flashwin.ops import position_bias
    if dispatched:
        monkeypatch.setattr(position_bias, "dispatch_free", lambda t: False)
    g = torch.Generator().manual_seed(3)
    index = relative_position_index(8, 8).to(KERNEL_DEVICE)
    values = 4 * torch.randn(225, 6, generator=g)
    grad = torch.randn(6, 64, 64, generator=g)
    table = values.to(dtype).to(KERNEL_DEVICE).clone().requires_grad_()
    bias = gather_position_bias(table, index, sigmoid_scale=16.0)
    bias.backward(grad.to(dtype).to(KERNEL_DEVICE))
    table64 = values.to(dtype).double().clone().requires_grad_()
    expected = 16 * torch.sigmoid(table64[index.cpu().view(-1)].view(64, 64, -1).permute(2, 0, 1))
    expected.backward(grad.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert bias.dtype == dtype and table.grad.dtype == dtype
    torch.testing.assert_close(bias.double().cpu(), expected.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(table.grad.double().cpu(), table64.grad, rtol=tol, atol=tol * 10)
    with torch.no_grad():  # without a gradient the same kernel, the same values
        torch.testing.assert_close(gather_position_bias(table, index, sigmoid_scale=16.0), bias.detach(),
                                   rtol=0, atol=0)
    table.grad = None
    nan_grad = grad.clone()
    nan_grad[2, 0, 5] = float("nan")
    gather_position_bias(table, index, sigmoid_scale=16.0).backward(nan_grad.to(dtype).to(KERNEL_DEVICE))
    rows, heads = torch.nonzero(table.grad.isnan(), as_tuple=True)
    assert rows.tolist() == [index[0, 5].item()] and heads.tolist() == [2]


@pytest.mark.parametrize("scale", [0, 0.0, float("inf"), True, "16"])
def test_sigmoid_scale_must_be_a_finite_nonzero_float(scale):
    with pytest.raises(ValueError, match="`sigmoid_scale` must be None or a finite nonzero float"):
        gather_position_bias(torch.zeros(9, 2).to(KERNEL_DEVICE), torch.zeros(2, 2, dtype=torch.long).to(KERNEL_DEVICE),
                             sigmoid_scale=scale)
