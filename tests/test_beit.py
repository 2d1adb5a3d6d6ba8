"""BEiT-style relative-position attention: timm's ``beit.Attention`` (beit_*, beitv2_*;
timm_flashwin/patching/adapters/beit.py) and transformers' ``BeitAttention`` and
``Data2VecVisionAttention`` (adapters/hf_beit.py), against their own unpatched models,
float64 as the referee, and the patcher's promises for them.

Global attention over the class token and the patches: tiny models under the interpreter
with token counts that are not powers of two (17, 26, 37 in one tile; 65 and 82 in key
blocks), a table per layer, the model's shared one, both, neither; the tables perturbed
(``verify.perturb_``: N(0, 1); timm and transformers start them at zero). The GPU tests run
beit_base at 224 and 384 and beit_large at 512 (1025 tokens) as timm makes them.
"""
import copy
import warnings

import pytest
import timm
import torch
from torch import nn

from conftest import KERNEL_DEVICE
from model_cases import flashwin_ops, images, recording_backend
from model_checks import compiled_against_timm, full_resolution_passes, judge, patched_in_place, training_step_runs
from timm_flashwin import patch_model, patch_report, patched_timm
from timm_flashwin.patching.adapters import beit as beit_adapter
from timm_flashwin.tools.hf_models import HF_PREFIX
from timm_flashwin.tools.verify import perturb_, verify_model

#: case -> (timm model, its configuration, image size): tokens (img / 4)^2 + 1
TIMM_CASES = {
    "table_37": ("beit_base_patch16_224", dict(), 24),
    "shared_82": ("beitv2_base_patch16_224", dict(use_rel_pos_bias=False, use_shared_rel_pos_bias=True), 36),
    "both_26": ("beit_base_patch16_224", dict(use_shared_rel_pos_bias=True), 20),
    "neither_17": ("beit_base_patch16_224", dict(use_rel_pos_bias=False), 16),
}
TINY = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_timm_beit_matches_timm(case):
    """A training step (float32, the kernels): every attention module's output, the model's
    and every parameter gradient (the tables' included) against timm's, verify's rule."""
    name, kwargs, size = TIMM_CASES[case]
    result = verify_model(name, img_size=size, batch=2, train=True, model_kwargs=dict(TINY, **kwargs))
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.patched_modules == len(result.layers) == 2
    tables = [c.name for c in result.grads if c.name.endswith("relative_position_bias_table")]
    assert len(tables) == {"table_37": 2, "shared_82": 1, "both_26": 3, "neither_17": 0}[case]


def tiny_timm(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("beit_base_patch16_224", img_size=20, drop_path_rate=0.0, **dict(TINY, **kwargs))
    return perturb_(model, 0)


def test_timm_beit_promises(monkeypatch):
    """state_dict, deepcopy, torch.save / load, unpatching bit for bit; beit_large at 512 px
    (1025 tokens) patched; a table for more tokens than the op takes is reported, and a
    module without one sees its token count per call: timm's forward, with a warning, for
    more; patch_timm patches what timm's factory makes."""
    model = tiny_timm(use_shared_rel_pos_bias=True).eval()
    with patched_in_place(model, images(1, (20, 20)), 2) as (expected, patched_out):
        torch.testing.assert_close(patched_out, expected, rtol=1e-4, atol=1e-5)
        assert "flashwin=beit" in repr(model.blocks[0].attn)
    with torch.device("meta"):
        large = patch_model(timm.create_model("beit_large_patch16_512"), strict=True)
    assert len(patch_report(large).patched) == 24
    with patched_timm() as created, torch.device("meta"):
        timm.create_model("beitv2_base_patch16_224")
    assert len(created) == 1 and len(created[0].report.patched) == 12
    monkeypatch.setattr(beit_adapter, "MAX_TOKENS", 16)
    report = patch_report(patch_model(tiny_timm()))
    assert {m.reason for m in report.skipped} == {
        "its relative-position bias is for 26 tokens (5x5 patches and the class token), more than 16"}
    plain = tiny_timm(use_rel_pos_bias=False).eval()
    ours = patch_model(copy.deepcopy(plain), strict=True)
    x = images(1, (20, 20))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(ours(x), plain(x), rtol=0, atol=0)
    assert any("got 26 tokens, more than the op's 16" in str(w.message) for w in caught)


def test_timm_beit_compiles_exports_and_scripts():
    """torch.compile(fullgraph=True): one graph, one op call per module, the output and a
    training step's gradients those of the eager patched model; torch.export keeps the op;
    torch.jit.script compiles timm's forward (no op)."""
    plain = tiny_timm(use_shared_rel_pos_bias=True).train().to(KERNEL_DEVICE)
    model = patch_model(copy.deepcopy(plain), strict=True)
    x = images(2, (20, 20), device=KERNEL_DEVICE)
    torch._dynamo.reset()
    graphs, results = [], []
    for net in (torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model):
        model.zero_grad(set_to_none=True)
        out = net(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(graphs) == 1 and flashwin_ops(graphs) == 2
    (compiled_out, compiled_grads), (eager_out, eager_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-6)
    for n, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(x)
        program = torch.export.export(model, (x,))
        targets = [str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"]
        assert sum(t.startswith("timm_flashwin.window_attention_fwd") for t in targets) == 2
        torch.testing.assert_close(program.module()(x), expected, rtol=1e-4, atol=1e-5)
        scripted = torch.jit.script(model)
        assert "timm_flashwin::" not in str(scripted.inlined_graph)
        torch.testing.assert_close(scripted(x), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ transformers
transformers = pytest.importorskip("transformers")

HF_GEOMETRY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=24,
                   patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                   num_labels=5, layer_scale_init_value=0.1)


class HfClassifier(nn.Module):
    """A transformers image classifier called on images, ``interpolate_pos_encoding`` as given."""

    def __init__(self, model: nn.Module, interpolate: bool = False):
        super().__init__()
        self.model, self.interpolate = model, interpolate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x, interpolate_pos_encoding=self.interpolate).logits


def hf_tiny(family: str, implementation: str, **config) -> nn.Module:
    """``family``'s (Beit, Data2VecVision) perturbed tiny classifier, train mode."""
    torch.manual_seed(0)
    make = getattr(transformers, f"{family}Config")
    model = getattr(transformers, f"{family}ForImageClassification")(
        make(**HF_GEOMETRY, **config, attn_implementation=implementation))
    with torch.no_grad():
        perturb_(model, 0)
    return model.train()


#: case -> (family, attention implementation, config, image size, interpolate_pos_encoding)
HF_CASES = {
    "beit_eager_table_37": ("Beit", "eager", dict(use_relative_position_bias=True), 24, False),
    # 8x8 patches of a table made for 6x6 (interpolated by transformers in every forward), the shared table too
    "beit_sdpa_both_interpolated_65": ("Beit", "sdpa", dict(use_relative_position_bias=True,
                                                            use_shared_relative_position_bias=True), 32, True),
    "data2vec_eager_table_37": ("Data2VecVision", "eager", dict(use_relative_position_bias=True), 24, False),
    "data2vec_sdpa_shared_interpolated_65": ("Data2VecVision", "sdpa",
                                             dict(use_shared_relative_position_bias=True), 32, True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_beit_matches_transformers(case):
    """A training step of the patched tiny classifier (float32, the kernels) against
    transformers': the output and every parameter gradient, the tables' (their gradient
    through transformers' own interpolation) included, verify's rule against float64."""
    family, implementation, config, size, interpolate = HF_CASES[case]
    model = HfClassifier(hf_tiny(family, implementation, **config), interpolate).to(KERNEL_DEVICE)
    ours = patch_model(copy.deepcopy(model), strict=True)
    assert {m.family for m in patch_report(ours).modules} == {f"hf_{'beit' if family == 'Beit' else 'data2vec_vision'}"}
    runs = training_step_runs(model, ours, images(2, (size, size), device=KERNEL_DEVICE))
    assert any(n.endswith("relative_position_bias_table") for n in runs[0][1])
    failed = judge(*runs)
    assert not failed, "\n".join(map(str, failed))


def test_transformers_beit_keeps_its_path(monkeypatch):
    """transformers' own forward where the call asks for attention weights, passes a mask
    that is not one bias for every image, or has more tokens than the op takes."""
    calls = []
    op = beit_adapter.WindowAttentionAdapter._project
    monkeypatch.setattr(beit_adapter.WindowAttentionAdapter, "_project",
                        lambda self, *args, **kwargs: (calls.append(1), op(self, *args, **kwargs))[1])
    x = images(2, (24, 24))
    for family in ("Beit", "Data2VecVision"):
        model = hf_tiny(family, "eager", use_relative_position_bias=True).eval()
        ours = patch_model(copy.deepcopy(model), strict=True)
        with torch.no_grad():
            expected = model(pixel_values=x, output_attentions=True)
            got = ours(pixel_values=x, output_attentions=True)
            assert not calls and len(got.attentions) == 2 and got.attentions[0] is not None
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
            ours(pixel_values=x)
            assert len(calls) == 2
            with monkeypatch.context() as limit:
                limit.setattr("timm_flashwin.patching.adapters.hf_beit.MAX_TOKENS", 16)
                torch.testing.assert_close(ours(pixel_values=x).logits, expected.logits, rtol=0, atol=0)
            assert len(calls) == 2
        calls.clear()


def test_transformers4():
    """This file's transformers tests again on a transformers 4.x (BEiT in the
    "attention_output" layout, as Data2VecVision in 5.x), in a subprocess whose path puts it
    first (test_hf_swin.py's test_transformers4 says where it comes from)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    where = os.environ.get("TIMM_FLASHWIN_TRANSFORMERS4")
    if not where or not (Path(where) / "transformers").is_dir():
        pytest.skip("TIMM_FLASHWIN_TRANSFORMERS4 does not name a directory holding transformers 4.x")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([where, str(root), os.environ.get("PYTHONPATH", "")]))
    env.pop("TIMM_FLASHWIN_TRANSFORMERS4")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "--override-ini=addopts=", __file__, "-k", "transformers and not gpu and not transformers4",
                             "-W", "ignore::DeprecationWarning"], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.splitlines()[-1].startswith("5 passed"), (
        result.stdout[-4000:] + result.stderr[-2000:])
    assert subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"], env=env,
                          capture_output=True, text=True).stdout.startswith("4.")


# ------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["beit_base_patch16_224", "beit_base_patch16_384", "beit_large_patch16_512"])
def test_gpu_full_resolution_autocast(name):
    """timm's models as it makes them (197, 577 and 1025 tokens), AMP bf16 training, forward
    and every gradient: verify's rule against a float64 copy."""
    full_resolution_passes(name, "bfloat16", batch=2 if "large" not in name else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("spec, tables", [
    ("beit", dict(use_relative_position_bias=True)),
    ("data2vec-vision", dict(use_relative_position_bias=True, use_shared_relative_position_bias=True))])
def test_gpu_transformers_base_configs(spec, tables):
    """transformers' default BEiT and Data2VecVision configs (base, 224) with their
    relative-position tables, AMP bf16 training through verify's rule."""
    result = verify_model(HF_PREFIX + spec, batch=2, dtype="bfloat16", device="cuda", train=True, model_kwargs=tables)
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.backend == "triton" and result.patched_modules == len(result.layers) == 12


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["timm", "beit_sdpa_both_interpolated_65", "data2vec_sdpa_shared_interpolated_65"])
def test_gpu_compiled_matches_unpatched(case):
    """torch.compile(fullgraph=True) of the patched model: one op call per module in every
    graph, eval output and a training step's gradients judged against the unpatched model's."""
    if case == "timm":
        model = timm.create_model("beit_base_patch16_224", drop_path_rate=0.0)
        failed = compiled_against_timm(perturb_(model, 0))
    else:
        family, implementation, config, size, interpolate = HF_CASES[case]
        model = HfClassifier(hf_tiny(family, implementation, **config), interpolate)
        model.pretrained_cfg = {"input_size": (3, size, size)}
        failed = compiled_against_timm(model, ops_per_graph=0 if _traced_mask_per_image(family) else None)
    assert not failed, "\n".join(map(str, failed))


def _traced_mask_per_image(family: str) -> bool:
    """Whether transformers' ``{family}Model`` hands its layers a bias per image under
    torch.compile: where ``create_bidirectional_mask`` builds its attend-everywhere mask while
    tracing (transformers 5.17; 5.24 skips it as in eager), the shared bias plus that (B, 1,
    N, N) mask is (B, H, N, N), which the op does not take, and the layers run transformers'
    forward (eager calls get no mask and are served)."""
    import importlib
    create = getattr(importlib.import_module(getattr(transformers, f"{family}Model").__module__),
                     "create_bidirectional_mask", None)
    if create is None:
        return False
    config = getattr(transformers, f"{family}Config")(attn_implementation="sdpa")

    @torch.compile(fullgraph=True, backend="eager")
    def probe(x):
        return torch.ones(1) if create(config=config, inputs_embeds=x, attention_mask=None) is None else torch.zeros(1)
    torch._dynamo.reset()
    return probe(torch.zeros(2, 5, 8)).item() == 0
