"""torch.func's transforms over patched models and the local-attention operators: under
them every call takes the registered operators, through an ``autograd.Function`` of each
(``dispatch.call_operator``; torch.library's own autograd for a custom operator has no
``setup_context``, which torch.func requires). ``grad`` / ``vjp`` give timm's gradients
(verify's rule, against float64), ``vmap`` without gradients timm's outputs, and
``vmap(grad(...))`` per-sample gradients, each operator run once per element (they have
no batching rule)."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import KERNEL_DEVICE
from model_checks import counting_transform_calls, gradient_transform_failures
from opcases import TOLERANCE, assert_matches_reference
from test_local_attention import make_inputs
from test_maxxvit import SIZE as MAXXVIT_SIZE, tiny as tiny_maxxvit
from test_tools import FAMILIES, create, images, pair
from test_window_families import MODELS as WINDOW_FAMILIES
from timm_flashwin import block_sliding_window_attention, sliding_window_attention
from timm_flashwin.ops.local_reference import block_window_visible, local_attention_reference
from timm_flashwin.tools.verify import build_model, perturb_


@pytest.fixture(autouse=True)
def _no_batching_rule_warnings():
    # "There is a performance drop because we have not yet implemented the batching rule"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swin_gradients(family):
    """Swin V1 (the bias gathered in the kernels), SwinV2 (cpb_mlp's kernels), SwinV2-CR."""
    plain = create(family)
    assert not gradient_transform_failures(plain, images(plain, batch=2))


@pytest.mark.parametrize("config", ["tf", "rmlp", "coatnet"])
def test_maxxvit_gradients(config):
    """MaxViT's block and grid windows read from the map (WindowGrid), its TF and MLP biases,
    CoAtNet's channels-first qkv; in eval mode (BatchNorm's statistics stay as they are)."""
    model = tiny_maxxvit(config).eval().to(KERNEL_DEVICE)
    x = torch.randn(2, 3, MAXXVIT_SIZE, MAXXVIT_SIZE, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    assert not gradient_transform_failures(model, x)


@pytest.mark.parametrize("family", ["tiny_vit", "hiera"])
def test_window_family_gradients(family):
    """TinyViT's (H, offsets) table, padded windows; Hiera's mask units and its q-pooling
    blocks."""
    name, overrides, size = WINDOW_FAMILIES[family]
    model = perturb_(build_model(name, img_size=size, train=True, model_kwargs=overrides), 0).eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    assert not gradient_transform_failures(model.to(KERNEL_DEVICE), x.to(KERNEL_DEVICE))


def _per_sample_grads(net, xs):
    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss(p, x):
        return torch.func.functional_call(net, p, (x,)).square().sum()

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)


def test_per_sample_gradients():
    """vmap(grad(...)): each image's own gradient, as timm's model gives it."""
    plain, model = pair("swinv2")
    xs = torch.stack([images(plain, seed=seed) for seed in range(2)])  # (2, 1, 3, H, W)
    with counting_transform_calls() as calls:
        ours = _per_sample_grads(model, xs)
    theirs = _per_sample_grads(plain, xs)
    assert calls["window_attention_fwd"] == 4 and calls["window_attention_bwd"] == 4
    scale = max(g.abs().max() for g in theirs.values())
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vmap_inference(family):
    """vmap without gradients gives timm's outputs (the eager path's direct launches could not
    read vmap's batched tensors: they have no storage)."""
    plain, model = pair(family)
    x = torch.stack([images(plain, seed=seed) for seed in range(2)])  # (2, 1, 3, H, W)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(model)(x), torch.func.vmap(plain)(x), rtol=1e-4, atol=1e-5)


def test_local_attention_gradients():
    """grad of a frame pattern with a sink and grouped-query heads, and vmap(grad) over a
    batch of sequences, against the float64 reference's autograd."""
    q, k, v, do = make_inputs(2, 2, 1, 20, 16)
    visible = block_window_visible(4, 2, 1)

    def ours(q, k, v):
        return block_sliding_window_attention(q, k, v, block_size=4, window_blocks=2, sink_tokens=1)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * do).sum()

    with counting_transform_calls() as calls:
        out, grads = ours(q, k, v), torch.func.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    assert calls["local_attention_fwd"] == 1 and calls["local_attention_bwd"] == 1
    doubles = [t.double() for t in (q, k, v)]
    expected = torch.func.grad(lambda *t: (local_attention_reference(*t, visible, None) * do.double()).sum(),
                               argnums=(0, 1, 2))(*doubles)
    assert_matches_reference([out, *grads], [local_attention_reference(*doubles, visible, None), *expected],
                             TOLERANCE[torch.float32], names=("out", "dq", "dk", "dv"))
    per_sequence = torch.func.vmap(torch.func.grad(lambda q, k, v: sliding_window_attention(
        q, k, v, window=(3, 2)).square().sum(), argnums=(0, 1, 2)))(q[:, None], k[:, None], v[:, None])
    whole = torch.func.grad(lambda q, k, v: sliding_window_attention(q, k, v, window=(3, 2)).square().sum(),
                            argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(per_sequence, whole):
        torch.testing.assert_close(a[:, 0], b, rtol=1e-5, atol=1e-6)
