"""The bound variant of benchmarks/bench_train.py computes what its docstring says: every
attention module (``attention-free``) reduced to proj(qkv(x)[..., :C]), and only that. The
bounds measured with it are as good as these."""
import os
import sys

import pytest
import timm
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_train import _attention_free_forward, attention_free  # noqa: E402

from timm_flashwin.patching.adapters import adapter_for  # noqa: E402

# small members of each family: two stages, shifted and unshifted blocks
MODELS = {
    "swin": lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(2, 4),
                                      embed_dim=32, num_classes=5),
    "swinv2": lambda: timm.create_model("swinv2_tiny_window8_256", img_size=64, window_size=4, depths=(2, 2),
                                        num_heads=(2, 4), embed_dim=32, num_classes=5),
    "swinv2_cr": lambda: timm.create_model("swinv2_cr_tiny_224", img_size=(56, 56), window_size=7, depths=(2, 2),
                                           num_heads=(2, 4), embed_dim=32, num_classes=5),
}


def _projections(attn, x):
    return attn.proj(attn.qkv(x)[..., :attn.proj.in_features])


@pytest.mark.parametrize("family", list(MODELS))
def test_attention_free_modules_project_the_windows(family):
    torch.manual_seed(0)
    model = attention_free(MODELS[family]().eval())
    attns = [m for m in model.modules() if adapter_for(m) is not None]
    assert len(attns) == 4
    for attn in attns:
        x = torch.randn(3, 5, attn.proj.in_features)
        torch.testing.assert_close(attn(x), _projections(attn, x), rtol=0, atol=0)


def test_attention_free_gcvit_keeps_the_global_query_networks_backward():
    """GCViT's global blocks take a q_global made by a network of its stage: the
    attention-free modules do not read it, yet that network's backward runs as with
    attention (its parameters get gradients, zero), and the output is the projections'."""
    torch.manual_seed(0)
    model = attention_free(timm.models.gcvit.GlobalContextVit(
        img_size=56, depths=(2, 2), num_heads=(1, 2), embed_dim=16, window_size=(7, 7), num_classes=5))
    attns = [m for m in model.modules() if adapter_for(m) is not None]
    assert len(attns) == 4 and sum(m.use_global for m in attns) == 2
    model(torch.randn(2, 3, 56, 56)).sum().backward()
    global_network = [p for n, p in model.named_parameters() if ".global_block." in n]
    assert global_network and all(p.grad is not None and not p.grad.any() for p in global_network)
    x, q_global = torch.randn(4, 49, 16), torch.randn(1, 7, 7, 16, requires_grad=True)
    torch.testing.assert_close(attns[1](x, q_global), _projections(attns[1], x), rtol=0, atol=0)


def test_attention_free_hiera_returns_one_token_a_query():
    """Hiera's q-pooling blocks (t / q_stride queries against t keys) are reduced like the
    others and return the module's output shape: one token a query, projected."""
    torch.manual_seed(0)
    model = timm.create_model("hiera_tiny_224", img_size=64, num_classes=5)
    attns = [m for m in model.modules() if adapter_for(m) is not None]
    pooling = [m for m in attns if m.q_stride > 1]
    assert pooling and all(adapter_for(m).unsupported(m) is None for m in attns)
    x = [torch.randn(2, 64 * m.q_stride, m.qkv.in_features) for m in pooling]
    expected = [m(t).shape for m, t in zip(pooling, x)]
    attention_free(model)
    assert all(m.forward.__func__ is _attention_free_forward for m in attns)
    for m, t, shape in zip(pooling, x, expected):
        out = m(t)
        assert out.shape == shape
        # (the two matmuls' shapes differ: a CPU BLAS may take other kernels, last bits apart)
        torch.testing.assert_close(out, _projections(m, t)[:, :t.shape[1] // m.q_stride], rtol=1e-5, atol=1e-6)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)


def test_attention_free_tiny_vit_normalizes_as_the_module_does():
    """TinyViT's Attention normalizes its own input before qkv: the bound keeps that norm."""
    torch.manual_seed(0)
    model = attention_free(timm.create_model("tiny_vit_5m_224", embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                                             num_heads=(1, 2, 2, 2), window_sizes=(7, 3, 4, 3), num_classes=5))
    attns = [m for m in model.modules() if adapter_for(m) is not None]
    assert len(attns) == 3
    for attn in attns:
        x = torch.randn(2, 9, attn.qkv.in_features)
        expected = attn.proj(attn.qkv(attn.norm(x))[..., :attn.proj.in_features])
        torch.testing.assert_close(attn(x), expected, rtol=0, atol=0)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)
