"""The timm blocks around patched modules: windows read from the feature map in place (until
unpatched), the position bias gathered within the op in training, SwinV2-CR's meta-MLP
bias in one autograd node, padded maps and dynamic masks, hooks, compiled blocks running
timm's method."""
import copy

import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from model_cases import autograd_nodes, create, images, maps_read_in_place, run_step, tiny_swin
from opcases import relative_error
from timm_flashwin import is_patched, patch_model, patched, unpatch_model
from timm_flashwin.patching.adapters.base import BLOCK_GRID_ATTR
from timm_flashwin.patching.model import FlashSwinTransformerBlock
from timm_flashwin.ops.window_grid import WindowGrid


# ------------------------------------------------------------ the blocks around the modules
SWIN_V1_BLOCK = timm.models.swin_transformer.SwinTransformerBlock


def test_blocks_read_their_windows_from_the_map_until_unpatched(monkeypatch):
    model = tiny_swin().eval()
    ours = patch_model(copy.deepcopy(model))
    blocks = [m for m in ours.modules() if isinstance(m, SWIN_V1_BLOCK)]
    assert [type(b) for b in blocks] == [FlashSwinTransformerBlock] * 4
    grids = maps_read_in_place(monkeypatch)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-5, atol=1e-6)
    # stage 1: 14 x 14, 2 x 2 windows, the second block shifted; stage 2: one 7 x 7 window, no shift
    assert grids == [WindowGrid(14, 14, (7, 7)), WindowGrid(14, 14, (7, 7), (3, 3)), WindowGrid(7, 7, (7, 7)),
                     WindowGrid(7, 7, (7, 7))]
    unpatch_model(ours)
    assert [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4
    assert not any(BLOCK_GRID_ATTR in b.__dict__ for b in blocks)
    with patched(ours):
        assert type(blocks[0]) is FlashSwinTransformerBlock
    assert type(blocks[0]) is SWIN_V1_BLOCK
    patch_model(ours, filter_fn=lambda module, name: name != "layers.0.blocks.1.attn")
    assert [type(b) for b in blocks] == [FlashSwinTransformerBlock, SWIN_V1_BLOCK] + [FlashSwinTransformerBlock] * 2
    patch_model(ours, feature_map=False)  # the modules patched, every block timm's
    assert is_patched(ours) and [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4
    with patched(ours):
        assert [type(b) for b in blocks] == [FlashSwinTransformerBlock] * 4
    assert [type(b) for b in blocks] == [SWIN_V1_BLOCK] * 4 and is_patched(ours)


@pytest.mark.parametrize("name, kwargs", [
    ("swin_tiny_patch4_window7_224", dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32)),
    ("swinv2_tiny_window8_256", dict(img_size=64, depths=(2, 2), num_heads=(2, 4), embed_dim=32)),
], ids=["swin", "swinv2"])
def test_training_gathers_the_position_bias_within_the_op(name, kwargs):
    """V1 and SwinV2 modules hand the op their bias table (``TableBias``): in eager training
    one autograd node per attention, none for a gather of its own."""
    model = patch_model(create(name, **kwargs)).to(KERNEL_DEVICE).train()
    nodes = autograd_nodes(model(images(1, (kwargs["img_size"],) * 2, device=KERNEL_DEVICE)))
    # the op's Python node, or where its calls replay a host program, the C++ one
    assert sum(name == "_EagerWindowAttentionBackward" or "HostProgramFunction" in name for name in nodes) == 4
    assert "_GatherFromTableBackward" not in nodes and "IndexBackward0" not in nodes


def test_training_computes_the_meta_mlp_bias_in_one_node():
    """SwinV2-CR modules compute their meta_mlp bias with ``position_mlp_table`` in eager
    training: one autograd node per attention for it, none of timm's linear layers, ReLU or
    dropout; in eval mode the same values (no dropout) as timm's method."""
    kwargs = dict(img_size=(56, 56), window_size=7, depths=(2, 2), embed_dim=48, num_heads=(3, 6))
    model = create("swinv2_cr_tiny_224", **kwargs).to(KERNEL_DEVICE)
    ours = patch_model(copy.deepcopy(model)).train()
    x = images(1, (56, 56), device=KERNEL_DEVICE)
    nodes = autograd_nodes(ours(x))
    timm_nodes = autograd_nodes(model.train()(x))
    assert nodes.count("_PositionMLPBackward") == 4
    # meta_mlp's two linear layers in each of the 4 modules; its ReLU and dropout are the only ones
    assert nodes.count("AddmmBackward0") == timm_nodes.count("AddmmBackward0") - 8
    assert timm_nodes.count("ReluBackward0") == 4 and "ReluBackward0" not in nodes
    assert not {"NativeDropoutBackward0", "MulBackward0"} & set(nodes)
    from timm_flashwin.patching.adapters.swinv2_cr import SwinV2CRAdapter
    with torch.no_grad():
        expected = model.stages[0].blocks[0].attn.eval()._relative_positional_encodings()[0]
        got = SwinV2CRAdapter().position_bias(ours.stages[0].blocks[0].attn.eval())
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_meta_mlp_training_after_an_inference_mode_call():
    """A SwinV2-CR model in training mode called under torch.inference_mode first (its
    dropout mask's ones then made there), then trained: its meta_mlp gradients are timm's,
    drawn from the same seed."""
    model = create("swinv2_cr_tiny_224", img_size=(56, 56), window_size=7, depths=(2, 2), embed_dim=48,
                   num_heads=(3, 6))
    ours = patch_model(copy.deepcopy(model)).train()
    x = images(1, (56, 56))
    with torch.inference_mode():
        ours(x)
    grad = torch.randn(1, model.num_classes, generator=torch.Generator().manual_seed(1))
    for net in (ours, model.train()):
        torch.manual_seed(1)
        (net(x) * grad).sum().backward()
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        ours_grad = ours.stages[0].blocks[0].attn.meta_mlp.get_parameter(name).grad
        timm_grad = model.stages[0].blocks[0].attn.meta_mlp.get_parameter(name).grad
        assert relative_error(ours_grad, timm_grad) < 1e-4, name


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_padded_maps_and_dynamic_masks(train, monkeypatch):
    """strict_img_size=False (newer timm also calls it dynamic_img_size): every block
    builds its mask per call (timm's dynamic_mask). At 84 x 84 stage 1 is 21 x 21 (3 x 3
    windows, read in place), stage 2 11 x 11, which timm pads to 14 x 14 (its padded tokens
    take part in the attention): timm's method."""
    model = tiny_swin(strict_img_size=False).to(KERNEL_DEVICE)
    ours = patch_model(copy.deepcopy(model))
    grids = maps_read_in_place(monkeypatch)
    x = images(size=(84, 84), device=KERNEL_DEVICE)
    timm_out, timm_grads = run_step(model, x, train)
    our_out, our_grads = run_step(ours, x, train)
    assert grids == [WindowGrid(21, 21, (7, 7)), WindowGrid(21, 21, (7, 7), (3, 3))]
    torch.testing.assert_close(our_out, timm_out, rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == timm_grads.keys()
    assert all(relative_error(our_grads[name], grad) < 1e-4 for name, grad in timm_grads.items())


def test_hooked_modules_are_called_by_their_blocks(monkeypatch):
    """A hook on the module (or on every module) would be skipped by reading the map in
    place: that block calls the module, as timm's method does."""
    model = tiny_swin().eval()
    ours = patch_model(copy.deepcopy(model))
    grids = maps_read_in_place(monkeypatch)
    seen = []
    handle = ours.layers[0].blocks[1].attn.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model(x), rtol=1e-5, atol=1e-6)
    assert seen == [(8, 49, 32)] and len(grids) == 3  # 2 images x 4 windows; the other three blocks in place
    handle.remove()
    grids.clear()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        with torch.no_grad():
            ours(x)
    finally:
        handle.remove()
    assert grids == []


def test_compiled_blocks_run_timms_method(monkeypatch):
    """Under torch.compile the blocks keep timm's copies (inductor fuses them): the traced
    method is timm's, calling the patched module."""
    ours = patch_model(tiny_swin()).eval()
    grids = maps_read_in_place(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(images())
    assert grids == []
