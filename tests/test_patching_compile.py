"""Patched models under torch.compile (whole model without graph break, SwinV2-CR's meta-MLP
bias through the operators, recompute_qkv followed), why patching swaps classes and does
not wrap with wrapt, and the GPU cases: full resolution under autocast, compiled inference
and training, compiled recompute_qkv."""
import copy
import math

import pytest
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from model_cases import create, flashwin_ops, images, recording_backend, tiny_swin
from model_checks import full_resolution_passes
from opcases import relative_error
from timm_flashwin import patch_model, patch_report, unpatch_model
from timm_flashwin.tools.comparison import compare


def test_compiles_whole_model_without_graph_break():
    """dynamo traces the patched modules in one graph, and the graph calls the op (a
    graph with timm's softmax instead would be numerically close: compare the graph)."""
    model = patch_model(tiny_swin()).eval().to(KERNEL_DEVICE)  # where the kernels run
    plain = unpatch_model(copy.deepcopy(model))
    x = images(device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs = []
    with torch.no_grad():
        torch.compile(plain, fullgraph=True, backend=recording_backend(graphs))(x)
        assert flashwin_ops(graphs) == 0
        out = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))(x)  # same code, new class
        assert len(graphs) == 2 and flashwin_ops(graphs[1:]) == 4
        assert not any("softmax" in t for t in graphs[1])
        assert torch.equal(out, model(x))


def test_compiled_cr_training_computes_the_meta_mlp_bias_with_the_operators():
    """Under torch.compile(fullgraph=True), a SwinV2-CR training step computes each module's
    meta_mlp bias with the registered position-MLP operator (one graph, no break), its
    dropout drawn in the graph (aot_eager keeps PyTorch's random numbers): the output and
    every gradient of the eager patched model."""
    model = patch_model(create("swinv2_cr_tiny_224", img_size=(56, 56), window_size=7, depths=(2, 2),
                               embed_dim=48, num_heads=(3, 6))).train().to(KERNEL_DEVICE)
    x = images(device=KERNEL_DEVICE)
    grad = torch.randn(2, model.num_classes, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = net(x)
        (out * grad).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(graphs) == 1 and sum("timm_flashwin.position_mlp_table" in t for t in graphs[0]) == 4
    (compiled_out, compiled_grads), (eager_out, eager_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
    assert all(relative_error(compiled_grads[n], g) < 1e-5 for n, g in eager_grads.items())

def test_why_not_wrapt():
    """Why patching swaps classes instead of wrapping timm's forward with wrapt (as first
    designed): a module whose class forward is a wrapt wrapper, called from its parent,
    runs the wrapper in eager mode but not under torch.compile, where dynamo calls the
    wrapped function instead, silently. The same module patched by a subclass whose
    forward is a plain method is traced as written. If the wrapt half of this test ever
    fails, dynamo has started calling wrapt wrappers and wrapt could be reconsidered."""
    wrapt = pytest.importorskip("wrapt")

    class Attention(nn.Module):
        def forward(self, x):
            return x.softmax(-1)

    def route(wrapped, instance, args, kwargs):  # what a wrapt-based patch would do
        return torch.sigmoid(args[0])

    class WraptPatched(Attention):
        forward = wrapt.FunctionWrapper(Attention.forward, route)

    class SubclassPatched(Attention):
        def forward(self, x):
            return torch.sigmoid(x)

    class Parent(nn.Module):
        def __init__(self, patched_class):
            super().__init__()
            self.attn = Attention()
            self.attn.__class__ = patched_class

        def forward(self, x):
            return self.attn(x) * 2

    x = torch.randn(3, 5)
    for patched_class, dynamo_runs_the_patch in ((WraptPatched, False), (SubclassPatched, True)):
        torch._dynamo.reset()
        graphs = []
        model = Parent(patched_class)
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))(x)
        torch.testing.assert_close(model(x), torch.sigmoid(x) * 2)  # eager runs the patch either way
        assert any("sigmoid" in t for t in graphs[0]) == dynamo_runs_the_patch, (patched_class.__name__, graphs)
        expected = torch.sigmoid(x) if dynamo_runs_the_patch else x.softmax(-1)
        torch.testing.assert_close(compiled, expected * 2)

# ------------------------------------------------------------------------ GPU only
GPU_MODELS = ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224",
              "swinv2_base_window12to16_192to256"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GPU_MODELS)
def test_gpu_full_resolution_autocast(name, dtype):
    """Full resolution, AMP (autocast, float32 weights), forward and every gradient:
    the patched model at most twice as far from float64 as timm itself, or within
    the dtype's tolerance."""
    full_resolution_passes(name, "bfloat16" if dtype == torch.bfloat16 else "float16")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224"])
def test_gpu_torch_compile_inference_and_training(name):
    """torch.compile(fullgraph=True) of a patched model: inference and a training step
    give what the eager patched model gives (float32, so that only inductor's fusions
    of the surrounding ops differ)."""
    torch._dynamo.reset()
    # SwinV2-CR's meta_mlp has dropout in training: inductor draws its own random numbers
    # unless told to use eager's, and both runs below start from the same seed.
    torch._inductor.config.fallback_random = True
    eager = patch_model(create(name, drop_path_rate=0.0)).cuda()
    compiled_src = copy.deepcopy(eager)
    graphs = []
    compiled = torch.compile(compiled_src, fullgraph=True, backend=recording_backend(graphs, "inductor"))
    x = images(4, eager.pretrained_cfg["input_size"][1:], device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(x), eager.eval()(x), rtol=1e-3, atol=1e-3)
    losses = []
    for net, params in ((compiled.train(), compiled_src), (eager.train(), eager)):
        opt = torch.optim.SGD(params.parameters(), lr=1e-3)
        torch.manual_seed(0)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isclose(*losses, rel_tol=1e-3)
    assert graphs and all(flashwin_ops([g]) == len(patch_report(eager).patched) for g in graphs)
    grads = dict(eager.named_parameters())
    for n, p in compiled_src.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        c = compare(n, p.grad, grads[n].grad, grads[n].grad, 1e-2, 1e-5)
        # SwinV2-CR's meta_mlp.fc2.bias has an exactly-zero true gradient (|g| ~ 1e-8): absolute
        assert c.err_ours < 5e-2 or c.max_abs < 1e-6, (n, c)


@pytest.mark.cuda
def test_gpu_torch_compile_recompute_qkv():
    """patch_model(recompute_qkv=True) under torch.compile(fullgraph=True), AMP bf16: a
    training step gives the plain patched model's loss and gradients, at a lower peak
    memory (the qkv projections' outputs, recomputed in the backward, are not kept); so
    does recompute_qkv for the second stage's modules only, by at least their share."""
    name, batch = "swin_tiny_patch4_window7_224", 16
    x = images(batch, (224, 224), device="cuda")
    runs = []
    for recompute in (False, True, lambda module, qualified_name: qualified_name.startswith("layers.1.")):
        torch._dynamo.reset()
        model = patch_model(create(name, drop_path_rate=0.0), recompute_qkv=recompute).cuda().train()
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # the first step compiles; the second is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(x).float().square().mean()
            loss.backward()
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        runs.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}, peak))
        del compiled, model
    (plain_loss, plain_grads, plain_peak), *recomputed = runs
    # the qkv outputs, (B_, N, 3 C) bf16 per block, of swin_tiny's (2, 2, 6, 2) blocks, per stage
    qkv_bytes = [depth * batch * (56 // 2 ** s) ** 2 * 3 * 96 * 2 ** s * 2 for s, depth in enumerate((2, 2, 6, 2))]
    for (loss, grads, peak), freed in zip(recomputed, (sum(qkv_bytes), qkv_bytes[1])):
        assert math.isclose(loss, plain_loss, rel_tol=1e-3)
        for n, g in grads.items():
            assert (g - plain_grads[n]).norm() <= 2e-2 * plain_grads[n].norm() + 1e-6, n
        assert plain_peak - peak >= 0.5 * freed, (plain_peak, peak, freed)


def test_compiled_model_follows_recompute_qkv():
    """A compiled patched model recompiles when patch_model turns recompute_qkv on or off:
    the training graph then holds a checkpointed region (the qkv projection and the op)
    or not."""
    model = patch_model(tiny_swin()).train().to(KERNEL_DEVICE)
    x = images(device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))
    checkpointed = []
    for recompute in (False, True, False):
        patch_model(model, recompute_qkv=recompute)
        before = len(graphs)
        compiled(x).sum().backward()
        checkpointed.append([any("checkpoint" in t for t in g) for g in graphs[before:]])
    assert checkpointed == [[False], [True], []]  # the last call reuses the first graph
