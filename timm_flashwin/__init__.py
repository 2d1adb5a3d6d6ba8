"""timm_flashwin: fused Triton window attention for timm's window-attention models (Swin,
SwinV2, SwinV2-CR, MaxViT, CoAtNet, TinyViT, DaViT, Twins-SVT, NesT, Hiera, GCViT).

    import timm, torch, timm_flashwin
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU computes in PyTorch
    model = timm.create_model("swinv2_tiny_window8_256").to(device)
    timm_flashwin.patch_model(model)           # in place, one line
    timm_flashwin.unpatch_model(model)         # timm's forward again
    with timm_flashwin.patched(model):         # temporary
        ...
    timm_flashwin.patch_timm()                 # every model timm.create_model returns, patched

Public API (``__all__``):

Patching models
    patch_model(model, *, strict, filter_fn, recompute_qkv, feature_map) -> model (in place)
    unpatch_model(model), patched(model, **kwargs) (context manager), is_patched(module)
    patch_report(model) -> PatchReport; PatchReport, ModuleStatus (one module),
    PatchError (strict=True: every module that cannot be served)
Patching timm's factory (for scripts you do not edit; CLI: ``timm-flashwin run``)
    patch_timm(**patch_model_kwargs), unpatch_timm(),
    patched_timm(**kwargs) (context manager yielding [CreatedModel])
    patch_transformers(**kwargs), unpatch_transformers(), patched_transformers(**kwargs): the
        same for transformers' from_pretrained / from_config (Swin, Swinv2, DonutSwin,
        MaskFormerSwin, Swin2SR; docs/support.md)
The window-attention op
    window_attention(qkv (B_, N, 3*H*D), num_heads, *, bias (H, N, N) | TableBias,
                     mask (nW, N, N), scale | logit_scale (H,), dropout_p, grid)
        -> (B_, N, H*D); with grid=WindowGrid(...), qkv (B, H*W, 3*H*D) -> (B, H*W, H*D)
    TableBias(table (T, H), index (N, N), sigmoid_scale): a bias read from its table
    WindowGrid(height, width, window, shift, strided): a block's (shifted) window partition, or
        MaxViT's strided grid windows
    window_attention_reference(...): the same math in PyTorch (the tests' oracle)
Local attention, q (B, H, S, D), k and v (B, H_kv, S, D) -> (B, H, S, D)
    sliding_window_attention(q, k, v, *, window=(left, right), causal, scale, dropout_p)
    block_sliding_window_attention(q, k, v, *, block_size, window_blocks, sink_tokens,
                                   scale, dropout_p)
Decomposed relative-position attention (SAM, ViTDet, MViTv2), global, any grid
    decomposed_attention(q, k, v, rel_h (B, H, S_q, key_h), rel_w (B, H, S_q, key_w), *,
                         key_size=(key_h, key_w), scale, dropout_p) -> (B, H, S_q, D)
    rel_pos_table_terms(q, rel_pos_h (L_h, D), rel_pos_w (L_w, D), q_size) -> (rel_h, rel_w):
        the terms from a model's own tables (SAM's), interpolated as it does
    rel_pos_terms(q, table_h (q_h, key_h, D), table_w (q_w, key_w, D), q_size) -> (rel_h, rel_w)

The host-program extension (eager calls on CUDA replayed from C++; ``TIMM_FLASHWIN_HOST_PROGRAMS=0``
turns it off)
    build_extensions() -> bool: build it now (about a minute, once per machine and torch
        version) rather than on the first eager call on a GPU

Command line: ``timm-flashwin verify | list | bench | run`` (``--help`` on each).
Design and measurements: docs/design.md and benchmarks/RESULTS.md in the repository.

Each name is imported from its module on first use (``timm_flashwin.patch_model`` imports
torch and timm then), so that ``import timm_flashwin`` and ``timm-flashwin --help`` stay
fast. The op's torch.library operators (``torch.ops.timm_flashwin``) are registered once
``timm_flashwin.ops`` is imported: through ``window_attention`` or a patched model's first
call, or ``import timm_flashwin.ops`` before loading an exported program that holds them.

The folders are the layers, each importing only from those below it (docs/design.md):
``kernels/`` (Triton kernels, their plans and launchers; ``window/``, ``local/``,
``position/``) < ``ops/`` (the operators, their checks, references and roads) <
``patching/`` (models: ``patch_model``, the factories, one adapter per family) < ``tools/``
(the CLI, verify, bench).
"""
import importlib
from typing import Any, List

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_SOURCES = {
    "CreatedModel": "patching.factory", "patch_timm": "patching.factory", "patched_timm": "patching.factory",
    "unpatch_timm": "patching.factory",
    "patch_transformers": "patching.factory_hf", "patched_transformers": "patching.factory_hf",
    "unpatch_transformers": "patching.factory_hf",
    "PatchError": "patching.report", "ModuleStatus": "patching.report", "PatchReport": "patching.report",
    "is_patched": "patching.model", "patch_model": "patching.model", "patch_report": "patching.model",
    "patched": "patching.model", "unpatch_model": "patching.model",
    "window_attention": "ops.window", "TableBias": "ops.position_bias", "WindowGrid": "ops.window_grid",
    "window_attention_reference": "ops.reference",
    "block_sliding_window_attention": "ops.local", "sliding_window_attention": "ops.local",
    "decomposed_attention": "ops.rel_pos", "rel_pos_terms": "ops.rel_pos",
    "rel_pos_table_terms": "ops.rel_pos",
    "build_extensions": "ops.native",
}

__all__ = sorted(_SOURCES) + ["__version__"]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_SOURCES))
