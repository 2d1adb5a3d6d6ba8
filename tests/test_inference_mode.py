"""torch.inference_mode, as users run inference: every family's patched model called there
first (what the adapters keep per module is then computed there), called again (reused), then
under no_grad and trained; and a model built under inference mode (its parameters inference
tensors, which have no version counter). The kernels under the interpreter, float32."""
import copy

import pytest
import torch

from model_cases import create, images, tiny_swin
from test_gcvit import tiny_model as tiny_gcvit
from test_maxxvit import SIZE as MAXXVIT_SIZE
from test_maxxvit import tiny as tiny_maxxvit
from test_window_families import MODELS as OTHER_FAMILIES
from timm_flashwin import patch_model
from timm_flashwin.tools.verify import build_model, perturb_

SMALL_V2 = dict(depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)

#: id -> (model maker, image size): one small model per family and bias kind (SwinV2-CR's
#: meta-MLP bias under inference mode: test_patching_blocks)
MODELS = {
    "swin": (tiny_swin, 56),
    "swinv2": (lambda: create("swinv2_tiny_window8_256", img_size=64, window_size=8, **SMALL_V2), 64),
    **{f"maxxvit_{config}": (lambda config=config: tiny_maxxvit(config), MAXXVIT_SIZE)
       for config in ("rw", "tf", "rmlp", "coatnet")},
    "gcvit": (tiny_gcvit, 56),
    **{family: (lambda name=name, overrides=overrides, size=size:
                perturb_(build_model(name, img_size=size, model_kwargs=overrides), 0), size)
       for family, (name, overrides, size) in OTHER_FAMILIES.items()},
}


@pytest.mark.parametrize("family", list(MODELS))
def test_inference_mode_first_then_no_grad_then_training(family):
    make, size = MODELS[family]
    ours = patch_model(make()).eval()
    x = images(1, (size, size))
    with torch.inference_mode():
        first, again = ours(x), ours(x)
    with torch.no_grad():
        plain = ours(x)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(plain, first, rtol=1e-6, atol=1e-6)
    ours.train()
    ours(x).square().mean().backward()  # what inference mode kept serves autograd too
    grads = [p.grad for p in ours.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("family", ["swin", "maxxvit_tf", "tiny_vit"])
def test_model_built_under_inference_mode(family):
    make, size = MODELS[family]
    x = images(1, (size, size))
    with torch.inference_mode():
        timm_model = make().eval()
        ours = patch_model(copy.deepcopy(timm_model))
        expected, first, again = timm_model(x), ours(x), ours(x)
    assert next(ours.parameters()).is_inference()
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
