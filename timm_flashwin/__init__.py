"""timm_flashwin: fused Triton window attention for timm's Swin, SwinV2 and SwinV2-CR.

    import timm, timm_flashwin
    model = timm.create_model("swinv2_tiny_window8_256").cuda()
    timm_flashwin.patch_model(model)           # in place, one line
    with timm_flashwin.patched(other_model):   # temporary
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

The host-program extension (eager calls on CUDA replayed from C++; ``TIMM_FLASHWIN_HOST_PROGRAMS=0``
turns it off)
    build_extensions() -> bool: build it now (about a minute, once per machine and torch
        version) rather than on the first eager call on a GPU

Command line: ``timm-flashwin verify | list | bench | run`` (``--help`` on each).
Design and measurements: docs/design.md and benchmarks/RESULTS.md in the repository.
"""
from .factory import CreatedModel, patch_timm, patched_timm, unpatch_timm
from .local_attention import block_sliding_window_attention, sliding_window_attention
from .native import build_extensions
from .op import window_attention
from .position_bias import TableBias
from .patching import PatchError, is_patched, patch_model, patch_report, patched, unpatch_model
from .report import ModuleStatus, PatchReport
from .reference import window_attention_reference
from .window_grid import WindowGrid

__version__ = "0.1.0"

__all__ = [
    "CreatedModel",
    "ModuleStatus",
    "PatchError",
    "PatchReport",
    "TableBias",
    "WindowGrid",
    "block_sliding_window_attention",
    "build_extensions",
    "is_patched",
    "patch_model",
    "patch_report",
    "patch_timm",
    "patched",
    "patched_timm",
    "sliding_window_attention",
    "unpatch_model",
    "unpatch_timm",
    "window_attention",
    "window_attention_reference",
    "__version__",
]
