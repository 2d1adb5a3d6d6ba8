"""torchvision's Swin V1, V2 and Video Swin (timm_flashwin/patching/adapters/tv_swin*.py): the
patched models and modules against torchvision's own, float64 as the referee, and the
patcher's promises for them.

torchvision is the oracle: its unpatched modules, every parameter perturbed
(``verify.perturb_``: the bias tables N(0, 1), V2's logit scales across the clamp, the
LayerNorms, V2's post-norms included, moved off their initialization). Under the
interpreter the configurations are tiny and chosen for torchvision's edges: maps padded to
whole windows before the shift, non-square and odd windows, a shift dropped where the
window covers the padded map, video windows shrunk to the clip (the index sliced) and
padded in time and space, 27 shift regions; the GPU tests run swin_t, swin_v2_t and
swin3d_t as torchvision makes them.
"""
import copy

import pytest
import torch
from torch import nn
from torchvision.models import swin_transformer as tv2d
from torchvision.models.video import swin_transformer as tv3d

from conftest import KERNEL_DEVICE
from model_cases import flashwin_ops, recording_backend
from model_checks import compiled_against_timm, full_resolution_passes, judge, patched_in_place, training_step_runs
from timm_flashwin import PatchError, patch_model, patch_report, unpatch_model
from timm_flashwin.kernels.window.bias_mask import mask_structure
from timm_flashwin.patching.adapters.rel_pos import KEPT_ATTR
from timm_flashwin.tools.comparison import compare
from timm_flashwin.tools.verify import build_model, perturb_

V2 = dict(block=tv2d.SwinTransformerBlockV2, downsample_layer=tv2d.PatchMergingV2)


def tiny(kind: str, window, seed: int = 0) -> nn.Module:
    """A perturbed two-stage torchvision Swin of 16 channels (heads 2 and 4), no stochastic depth."""
    torch.manual_seed(seed)
    if kind == "3d":
        model = tv3d.SwinTransformer3d([2, 4, 4], 16, [2, 2], [2, 4], window, stochastic_depth_prob=0.0,
                                       num_classes=5)
    else:
        model = tv2d.SwinTransformer([4, 4], 16, [2, 2], [2, 4], window, stochastic_depth_prob=0.0, num_classes=5,
                                     **(V2 if kind == "v2" else {}))
    return perturb_(model, seed)


#: case -> (kind, window, input (B, 3, [T,] H, W))
MODEL_CASES = {
    # maps 6x10 in 3x5 windows (filled, shifted (1, 2)); 3x5: one window, no shift
    "v1_filled_odd": ("v1", [3, 5], (2, 3, 24, 40)),
    # 7x7 padded to 9x9 before the shift; 4x4 padded to 6x6
    "v1_padded": ("v1", [3, 3], (1, 3, 28, 28)),
    # 5x9 padded to 8x12; 3x5 padded to 4x8, the shift kept along the width only
    "v2_padded": ("v2", [4, 4], (1, 3, 20, 36)),
    # 5x4x4 padded to 8x6x6 (time and space), shift (2, 1, 1): 27 regions; 5x2x2: the
    # window shrunk to 4x2x2 (the index sliced), shift (2, 0, 0)
    "3d_padded_shrunk": ("3d", [4, 3, 3], (1, 3, 10, 16, 16)),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_patched_model_matches_torchvision(case):
    """A training step (float32, the kernels): the output and every parameter gradient
    against torchvision's, with verify's rule (a float64 copy the referee)."""
    kind, window, shape = MODEL_CASES[case]
    model = tiny(kind, window).train()
    ours = patch_model(copy.deepcopy(model), strict=True)
    assert len(patch_report(ours).patched) == 4
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    runs = training_step_runs(model.to(KERNEL_DEVICE), ours.to(KERNEL_DEVICE), x.to(KERNEL_DEVICE))
    assert len(runs[2][1]) == len(list(model.parameters()))  # every parameter has its gradient
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))


#: case -> (module, input (B, [T,] H, W, C)): each class alone, with the input's gradient
MODULE_CASES = {
    "v1": (lambda: tv2d.ShiftedWindowAttention(32, [3, 4], [1, 2], 2), (2, 7, 9, 32)),
    "v2": (lambda: tv2d.ShiftedWindowAttentionV2(32, [4, 3], [2, 1], 2), (2, 6, 7, 32)),
    # 80-token windows (the kernels that stream key blocks), padded in time and space
    "3d_multi_block": (lambda: tv3d.ShiftedWindowAttention3d(32, [4, 4, 5], [2, 2, 2], 2), (1, 6, 5, 7, 32)),
}


@pytest.mark.parametrize("case, recompute_qkv", [(case, False) for case in MODULE_CASES] + [("v2", True)])
def test_module_matches_torchvision(case, recompute_qkv):
    """Each class alone in training mode: its output, the input's gradient and every
    parameter's (qkv, proj, the table; V2's cpb_mlp and logit_scale) against torchvision's
    module in float32 and float64, verify's rule; V2 with recompute_qkv too."""
    make, shape = MODULE_CASES[case]
    torch.manual_seed(0)
    module = perturb_(make())
    ours = patch_model(copy.deepcopy(module), strict=True, recompute_qkv=recompute_qkv)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    results = []
    for net, dtype in ((ours, torch.float32), (module, torch.float32), (copy.deepcopy(module), torch.float64)):
        net = net.to(KERNEL_DEVICE, dtype).train()
        x_in = x.to(KERNEL_DEVICE, dtype, copy=True).requires_grad_()
        out = net(x_in)
        out.backward(grad.to(out))
        results.append([out, x_in.grad] + [p.grad for p in net.parameters()])
    assert len(results[0]) == len(results[2]) == 2 + len(list(module.parameters()))
    for i, (got, plain, ref) in enumerate(zip(*results)):
        assert got is not None and got.shape == ref.shape
        comparison = compare(str(i), got, plain, ref, 1e-4, 1e-6)
        assert comparison.passed, comparison


def test_shift_masks_are_kept_per_shape_and_are_torchvisions():
    """The shift mask is built once per padded size, window, shift and device and kept on the
    module (the op keeps its region ids on it), never stale: another map size builds
    another. The 3-D one is torchvision's own function's, and every dimension shifting gives
    windows of 27 regions, which the op's region ids describe exactly."""
    module = tv3d.ShiftedWindowAttention3d(16, [2, 3, 3], [1, 1, 1], 2).eval()
    patch_model(module, strict=True)
    with torch.no_grad():
        module(torch.randn(1, 4, 6, 6, 16))
        first = module.__dict__[KEPT_ATTR]["shift_mask"][1]
        module(torch.randn(1, 4, 6, 6, 16))
        assert module.__dict__[KEPT_ATTR]["shift_mask"][1] is first
        module(torch.randn(1, 4, 5, 6, 16))  # padded to 4x6x6: the same mask
        assert module.__dict__[KEPT_ATTR]["shift_mask"][1] is first
        module(torch.randn(1, 6, 6, 6, 16))
        assert module.__dict__[KEPT_ATTR]["shift_mask"][1] is not first
    expected = tv3d._compute_attention_mask_3d(torch.empty(0), (4, 6, 6), (2, 3, 3), (1, 1, 1))
    assert torch.equal(first, expected)
    # region ids exact (info[0]); 27 regions over the clip, the last window holding 8 of them
    regions, info = mask_structure(first)
    assert info[0] == 1 and regions.shape == (8, 18) and len(set(regions[-1].tolist())) == 8
    assert info[2:].tolist() == [1.0] + [0.0] * 7  # only the first window is one region
    unpatch_model(module)
    assert KEPT_ATTR not in module.__dict__


def test_patching_promises():
    """state_dict, deepcopy, torch.save / load and unpatching (torchvision's output bit for bit)
    for each family; strict names a module the op cannot serve (a shift outside the window),
    filter_fn opts one out; repr shows the family."""
    for kind, window, shape in (("v2", [4, 4], (1, 3, 16, 16)), ("3d", [2, 3, 3], (1, 3, 4, 12, 12))):
        model = tiny(kind, window).eval()
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with patched_in_place(model, x, 4) as (expected, patched_out):
            torch.testing.assert_close(patched_out, expected, rtol=1e-4, atol=1e-5)
            assert "flashwin=tv_swin" in repr(model)
    model = tiny("v1", [3, 3])
    model.features[1][1].attn.shift_size = [3, 1]
    with pytest.raises(PatchError, match=r"features\.1\.1\.attn: shift_size \[3, 1\] is not within"):
        patch_model(model, strict=True)
    report = patch_report(patch_model(model, filter_fn=lambda m, name: not name.startswith("features.3")))
    assert [(m.name, m.patched) for m in report.modules] == [
        ("features.1.0.attn", True), ("features.1.1.attn", False), ("features.3.0.attn", False),
        ("features.3.1.attn", False)]
    assert {m.family for m in report.modules} == {"tv_swin"}


class ImageAndClip(nn.Module):
    """A tiny V2 model on 16x16 images (a shift mask) and a tiny video model on 6x16x16 clips
    (a shift mask, then a window shrunk to the clip: the index sliced, a time-only shift)."""

    def __init__(self):
        super().__init__()
        self.image, self.video = tiny("v2", [4, 4]), tiny("3d", [2, 3, 3], seed=1)

    def forward(self, image: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.image(image), self.video(clip)), 1)


def image_and_clip():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(1, 3, 16, 16, generator=generator).to(KERNEL_DEVICE),
            torch.randn(1, 3, 6, 16, 16, generator=generator).to(KERNEL_DEVICE))


def test_compiles_without_graph_break():
    """torch.compile(fullgraph=True): one graph, one op call per module, the shift masks and
    the sliced index constants of the graph; a training step's output and gradients those of
    the eager patched model."""
    model = patch_model(ImageAndClip(), strict=True).train().to(KERNEL_DEVICE)
    inputs = image_and_clip()
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        out = net(*inputs)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(graphs) == 1 and flashwin_ops(graphs) == 8
    assert not any("masked_fill" in t or "slice" in t for t in graphs[0])  # masks and index: constants
    (compiled_out, compiled_grads), (eager_out, eager_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-6)
    for n, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_export_keeps_the_op_and_script_takes_torchvisions_forward():
    """torch.export.export traces the operator into the program (the masks and the sliced
    index computed in its graph), whose output is torchvision's; torch.jit.script compiles
    torchvision's forward (no op), and the eager model stays patched."""
    plain = ImageAndClip().eval().to(KERNEL_DEVICE)
    model = patch_model(copy.deepcopy(plain), strict=True)
    inputs = image_and_clip()
    with torch.no_grad():
        expected = plain(*inputs)
        program = torch.export.export(model, inputs)
        targets = [str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"]
        assert sum(t.startswith("timm_flashwin.window_attention_fwd") for t in targets) == 8
        torch.testing.assert_close(program.module()(*inputs), expected, rtol=1e-4, atol=1e-5)
        scripted = torch.jit.script(model)
        assert "timm_flashwin::" not in str(scripted.inlined_graph)
        torch.testing.assert_close(scripted(*inputs), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(*inputs), expected, rtol=1e-4, atol=1e-5)
    assert len(patch_report(model).patched) == 8


# ------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["swin_t", "swin_v2_t", "swin3d_t"])
def test_gpu_full_size_autocast(name):
    """torchvision's models as it makes them, AMP bf16 training, forward and every gradient:
    verify's rule against a float64 copy (swin3d_t on two clips of 16 x 224 x 224)."""
    full_resolution_passes(f"tv:{name}", "bfloat16", batch=2 if name != "swin3d_t" else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["swin_t", "swin_v2_t", "swin3d_t"])
def test_gpu_compiled_matches_torchvision(name):
    """torch.compile(fullgraph=True, inductor) of the patched model (float32, perturbed): one op
    call per module in every graph, eval output and a training step's gradients judged
    against torchvision's (swin3d_t on clips of 16 x 112 x 112)."""
    model = build_model(f"tv:{name}", img_size=112 if name == "swin3d_t" else None, train=True)
    failed = compiled_against_timm(perturb_(model, 0))
    assert not failed, "\n".join(map(str, failed))
