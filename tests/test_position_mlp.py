"""position_mlp_table: SwinV2's cpb_mlp in one kernel forward and one backward (interpreter
on CPU in CI) against float64 autograd of timm's layers."""
import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from timm_flashwin.ops.position_mlp import fusable_cpb_mlp, position_mlp_table


def _mlp_inputs(rows, hidden, heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    coords = (8 * torch.rand(rows, 2, generator=g) - 4).to(dtype)  # SwinV2's log-spaced range
    w1, b1 = torch.randn(hidden, 2, generator=g), torch.randn(hidden, generator=g)
    w2 = torch.randn(heads, hidden, generator=g) / hidden ** 0.5
    return coords, *(t.to(dtype) for t in (w1, b1, w2))


def _float64_table(coords, w1, b1, w2):
    """timm's layers in float64: Linear -> ReLU -> Linear(bias=False), with weight grads."""
    params = [t.detach().double().cpu().requires_grad_() for t in (w1, b1, w2)]
    out = torch.relu(coords.double().cpu() @ params[0].T + params[1]) @ params[2].T
    return out, params


@pytest.mark.parametrize("dispatched", [False, True], ids=["function", "operator"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, hidden, heads", [
    pytest.param(225, 512, 3, id="w8"), pytest.param(49, 64, 6, id="w4-narrow"),
    pytest.param(300, 200, 17, id="ragged"), pytest.param(700, 128, 4, id="several-groups"),
    # window 24 (SwinV2-base w24: 32 heads in its last stage), on the GPU only
    pytest.param(2209, 512, 32, id="w24", marks=pytest.mark.cuda),
])
def test_table_and_weight_gradients_match_float64(rows, hidden, heads, dtype, dispatched, monkeypatch):
    """The table (fp32) and the three weight gradients (in the weights' dtype), through the
    eager autograd.Function and through the registered operators, against float64; shapes
    with partial tiles of rows, hidden units and heads, and with several row groups whose
    partial sums the backward adds up (700 rows)."""
    from timm_flashwin.ops import position_mlp
    if dispatched:
        monkeypatch.setattr(position_mlp, "dispatch_free", lambda t: False)
    coords, w1, b1, w2 = (t.to(KERNEL_DEVICE) for t in _mlp_inputs(rows, hidden, heads, dtype))
    params = [t.clone().requires_grad_() for t in (w1, b1, w2)]
    table = position_mlp_table(coords, *params)
    grad = torch.randn(rows, heads, generator=torch.Generator().manual_seed(1))
    table.backward(grad.to(KERNEL_DEVICE))
    expected, params64 = _float64_table(coords, w1, b1, w2)
    expected.backward(grad.double())
    assert table.dtype == torch.float32 and table.shape == (rows, heads)
    # fp32 arithmetic from the inputs as given: the float64 reference of the same inputs
    torch.testing.assert_close(table.double().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for p, p64 in zip(params, params64):
        assert p.grad.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradient's rounding
        scale = p64.grad.abs().max()
        torch.testing.assert_close(p.grad.double().cpu() / scale, p64.grad / scale, rtol=tol, atol=tol)
    with torch.no_grad():  # without a gradient: the same kernel, the same values
        torch.testing.assert_close(position_mlp_table(coords, w1, b1, w2), table.detach(), rtol=0, atol=0)


def test_nan_propagates_as_in_pytorch():
    """A NaN weight reaches the table entries and gradients that PyTorch's layers give NaN
    (ReLU keeps NaN; its gradient passes where its output is NaN)."""
    coords, w1, b1, w2 = _mlp_inputs(81, 64, 5, torch.float32)
    w1[7, 0] = float("nan")  # hidden unit 7: NaN for every row
    b1[3] = -1e4  # hidden unit 3: off everywhere
    params = [t.to(KERNEL_DEVICE).requires_grad_() for t in (w1, b1, w2)]
    table = position_mlp_table(coords.to(KERNEL_DEVICE), *params)
    grad = torch.randn(81, 5)
    grad[10] = 0.0
    table.backward(grad.to(KERNEL_DEVICE))
    expected, params64 = _float64_table(coords, w1, b1, w2)
    expected.backward(grad.double())
    assert torch.equal(table.isnan().cpu(), expected.isnan())
    for p, p64 in zip(params, params64):
        assert torch.equal(p.grad.isnan().cpu(), p64.grad.isnan())
        finite = ~p64.grad.isnan()
        torch.testing.assert_close(p.grad.cpu()[finite].double(), p64.grad[finite], rtol=1e-4, atol=1e-4)


def test_compiled_table_takes_the_registered_operators():
    """Under torch.compile (one graph, no break) the table and its gradients come from the
    registered operators: the same values as the eager path."""
    coords, w1, b1, w2 = (t.to(KERNEL_DEVICE) for t in _mlp_inputs(225, 96, 4, torch.float32))
    grad = torch.randn(225, 4).to(KERNEL_DEVICE)
    results = []
    for fn in (position_mlp_table, torch.compile(position_mlp_table, backend="aot_eager", fullgraph=True)):
        params = [t.clone().requires_grad_() for t in (w1, b1, w2)]
        table = fn(coords, *params)
        table.backward(grad)
        results.append((table.detach(), *(p.grad for p in params)))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("shapes, message", [
    (((9, 3), (4, 2), (4,), (2, 4)), "`coords` must be of shape"),
    (((9, 2), (4, 3), (4,), (2, 4)), "expected w1"),
    (((9, 2), (4, 2), (5,), (2, 4)), "expected w1"),
    (((9, 2), (4, 2), (4,), (2, 5)), "expected w1"),
    (((0, 2), (4, 2), (4,), (2, 4)), "`coords` must be of shape"),
    (((9, 2), (0, 2), (0,), (2, 0)), "expected w1"),
    (((9, 2), (4, 2), (4,), (0, 4)), "expected w1"),
])
def test_bad_shapes_name_the_argument(shapes, message):
    with pytest.raises(ValueError, match=message):
        position_mlp_table(*(torch.zeros(s).to(KERNEL_DEVICE) for s in shapes))


def test_only_timms_cpb_mlp_is_fused():
    """timm's SwinV2 cpb_mlp is fused; a module of another structure, or one a forward hook
    (its own, a layer's, or a global one) observes, keeps PyTorch's layers."""
    attn = timm.create_model("swinv2_tiny_window8_256", pretrained=False).layers[0].blocks[0].attn
    assert fusable_cpb_mlp(attn.cpb_mlp)
    assert not fusable_cpb_mlp(nn.Sequential(nn.Linear(2, 8), nn.GELU(), nn.Linear(8, 3, bias=False)))
    assert not fusable_cpb_mlp(nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)))
    assert not fusable_cpb_mlp(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3, bias=False)))
    for module in (attn.cpb_mlp, attn.cpb_mlp[0]):
        handle = module.register_forward_hook(lambda *args: None)
        assert not fusable_cpb_mlp(attn.cpb_mlp)
        handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not fusable_cpb_mlp(attn.cpb_mlp)
    finally:
        handle.remove()
    assert fusable_cpb_mlp(attn.cpb_mlp)


def test_coordinates_that_take_a_gradient_get_it():
    """The kernels give the weights' gradients only; coordinates that require a gradient
    are computed by PyTorch's expression instead, and get theirs."""
    coords, w1, b1, w2 = (t.to(KERNEL_DEVICE) for t in _mlp_inputs(49, 32, 3, torch.float32))
    coords.requires_grad_()
    table = position_mlp_table(coords, w1, b1, w2)
    table.sum().backward()
    expected = torch.relu(coords.detach().double() @ w1.double().T + b1.double()) @ w2.double().T
    torch.testing.assert_close(table.double(), expected, rtol=1e-5, atol=1e-5)
    assert coords.grad is not None and coords.grad.abs().sum() > 0


# ----------------------------------------------------------- SwinV2-CR's meta_mlp form
def _float64_meta_table(coords, w1, b1, w2, b2, keep, dropout_p):
    """timm's Mlp in float64: Linear -> ReLU -> dropout (the given mask) -> Linear(bias)."""
    params = [t.detach().double().cpu().requires_grad_() for t in (w1, b1, w2, b2)]
    hidden = torch.relu(coords.double().cpu() @ params[0].T + params[1])
    hidden = hidden * (keep.cpu() != 0) / (1 - dropout_p)
    return hidden @ params[2].T + params[3], params


@pytest.mark.parametrize("dispatched", [False, True], ids=["function", "operator"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, hidden, heads, mask_dtype", [
    pytest.param(49 * 49, 96, 3, torch.float32, id="w7-float-mask"),
    pytest.param(16 * 16, 40, 5, torch.bool, id="w4-bool-mask-ragged"),
    pytest.param(9 * 9, 384, 24, None, id="w3-no-dropout"),
    # SwinV2-CR-tiny's last stage (24 heads, K = 384) with the mask F.dropout gives under AMP
    pytest.param(49 * 49, 384, 24, torch.bfloat16, id="w7-cr-tiny", marks=pytest.mark.cuda),
])
def test_meta_mlp_table_and_gradients_match_float64(rows, hidden, heads, mask_dtype, dtype, dispatched, monkeypatch):
    """SwinV2-CR's form (a bias on the second layer, dropout on the hidden units from a
    given mask, the table written heads-first): the table and all four weight gradients,
    through the eager autograd.Function and the registered operators, against float64;
    several row groups (2401 rows), partial tiles of hidden units and heads."""
    from timm_flashwin.ops import position_mlp
    if dispatched:
        monkeypatch.setattr(position_mlp, "dispatch_free", lambda t: False)
    g = torch.Generator().manual_seed(3)
    coords, w1, b1, w2 = (t.to(KERNEL_DEVICE) for t in _mlp_inputs(rows, hidden, heads, dtype))
    b2 = torch.randn(heads, generator=g).to(dtype).to(KERNEL_DEVICE)
    p = 0.125
    keep = torch.rand(rows, hidden, generator=g) >= p
    if mask_dtype is not None:
        keep = keep.to(mask_dtype) / (1 - p) if mask_dtype != torch.bool else keep  # as F.dropout of ones gives
    mask = keep.to(KERNEL_DEVICE) if mask_dtype is not None else None
    params = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    table = position_mlp_table(coords, *params, dropout_mask=mask, dropout_p=p, heads_first=True)
    assert table.shape == (heads, rows) and table.is_contiguous() and table.dtype == torch.float32
    grad = torch.randn(heads, rows, generator=g)
    table.backward(grad.to(KERNEL_DEVICE))
    keep64 = keep if mask is not None else torch.ones(rows, hidden)
    expected, params64 = _float64_meta_table(coords, w1, b1, w2, b2, keep64, p if mask is not None else 0.0)
    expected.t().backward(grad.double())
    torch.testing.assert_close(table.double().cpu(), expected.detach().t(), rtol=1e-5, atol=1e-5)
    for param, p64 in zip(params, params64):
        assert param.grad.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        scale = p64.grad.abs().max()
        torch.testing.assert_close(param.grad.double().cpu() / scale, p64.grad / scale, rtol=tol, atol=tol)


def test_meta_mlp_nan_propagates_through_the_dropout():
    """A NaN hidden unit stays NaN where the dropout drops it (NaN * 0), in the table and
    in the gradients, as PyTorch's dropout gives."""
    rows, hidden, heads = 64, 32, 3
    coords, w1, b1, w2 = _mlp_inputs(rows, hidden, heads, torch.float32)
    b2 = torch.randn(heads)
    w1[5, 1] = float("nan")
    keep = torch.ones(rows, hidden, dtype=torch.bool)
    keep[:, 5] = False  # the NaN unit dropped everywhere
    keep[::3, 9] = False
    params = [t.to(KERNEL_DEVICE).requires_grad_() for t in (w1, b1, w2, b2)]
    table = position_mlp_table(coords.to(KERNEL_DEVICE), *params, dropout_mask=keep.to(KERNEL_DEVICE),
                               dropout_p=0.25)
    grad = torch.randn(rows, heads)
    table.backward(grad.to(KERNEL_DEVICE))
    expected, params64 = _float64_meta_table(coords, w1, b1, w2, b2, keep, 0.25)
    expected.backward(grad.double())
    assert table.isnan().all() and expected.isnan().all()
    for param, p64 in zip(params, params64):
        assert torch.equal(param.grad.isnan().cpu(), p64.grad.isnan()), param.shape


def test_meta_mlp_bad_inputs_name_the_argument():
    coords, w1, b1, w2 = (t.to(KERNEL_DEVICE) for t in _mlp_inputs(16, 8, 3, torch.float32))
    with pytest.raises(ValueError, match="`b2` must be of shape"):
        position_mlp_table(coords, w1, b1, w2, torch.zeros(4).to(KERNEL_DEVICE))
    with pytest.raises(ValueError, match="`dropout_mask` must be of shape"):
        position_mlp_table(coords, w1, b1, w2, dropout_mask=torch.ones(8, 16).to(KERNEL_DEVICE), dropout_p=0.1)
    with pytest.raises(ValueError, match="`dropout_p` must be a float in"):
        position_mlp_table(coords, w1, b1, w2, dropout_mask=torch.ones(16, 8).to(KERNEL_DEVICE), dropout_p=1.0)


def _cr_attention():
    model = timm.create_model("swinv2_cr_tiny_224", pretrained=False, img_size=(56, 56), window_size=7,
                              depths=(2, 2), embed_dim=48, num_heads=(3, 6))
    return model.stages[0].blocks[0].attn


def test_only_timms_meta_mlp_is_fused():
    """timm's SwinV2-CR meta_mlp is fused; another activation, a second dropout, an
    in-place dropout, a norm, or a forward hook keep timm's layers."""
    from timm.layers import Mlp
    from timm_flashwin.ops.position_mlp import fusable_meta_mlp
    attn = _cr_attention()
    assert fusable_meta_mlp(attn.meta_mlp)
    assert not fusable_meta_mlp(Mlp(2, 16, 3, act_layer=nn.GELU))
    assert not fusable_meta_mlp(Mlp(2, 16, 3, act_layer=nn.ReLU, drop=(0.1, 0.1)))
    assert not fusable_meta_mlp(Mlp(2, 16, 3, act_layer=nn.ReLU, norm_layer=nn.LayerNorm))
    assert not fusable_meta_mlp(Mlp(3, 16, 3, act_layer=nn.ReLU))
    assert not fusable_meta_mlp(nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)))
    in_place = Mlp(2, 16, 3, act_layer=nn.ReLU, drop=(0.1, 0.0))
    in_place.drop1.inplace = True
    assert not fusable_meta_mlp(in_place)
    handle = attn.meta_mlp.drop1.register_forward_hook(lambda *args: None)
    assert not fusable_meta_mlp(attn.meta_mlp)
    handle.remove()
    assert fusable_meta_mlp(attn.meta_mlp)


@pytest.mark.parametrize("device", [KERNEL_DEVICE, pytest.param("cuda", marks=pytest.mark.cuda)],
                         ids=["kernel-device", "cuda"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_meta_mlp_dropout_mask_is_timms(autocast, device):
    """The mask drawn for a training call is the one timm's drop1 draws from the same RNG
    state (so every later draw matches timm's too), on the device the kernels run on: the
    dropped hidden units of timm's own forward are the mask's zeros; the generator ends in
    the same state. In eval mode nothing is drawn."""
    from timm_flashwin.ops.position_mlp import meta_mlp_dropout_mask
    attn = _cr_attention().to(device).train()
    mlp, coords = attn.meta_mlp, attn.relative_coordinates_log
    seen = {}
    handle = mlp.drop1.register_forward_hook(lambda m, args, out: seen.update(inp=args[0], out=out))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        torch.manual_seed(5)
        mlp(coords)
        after_timm = torch.rand(4, device=device)
        torch.manual_seed(5)
        mask = meta_mlp_dropout_mask(mlp, coords)
        after_ours = torch.rand(4, device=device)
    handle.remove()
    assert mask.shape == seen["inp"].shape and mask.dtype == seen["inp"].dtype
    assert torch.equal(after_ours, after_timm)
    live = seen["inp"] > 0  # where timm's hidden unit was nonzero, its dropout shows the mask
    assert torch.equal((seen["out"] != 0)[live], (mask != 0)[live])
    assert 0.8 < (mask != 0).float().mean() < 0.95  # p = 0.125
    mlp.eval()
    assert meta_mlp_dropout_mask(mlp, coords) is None
