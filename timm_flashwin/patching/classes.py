"""The patched subclasses: the class a served module (and the timm block holding it) takes.

Patching swaps a module's ``__class__`` to a subclass of its timm class defined here
(``FlashSwinWindowAttention``, ``FlashSwinV2WindowAttention``, ...; ``PATCHED_CLASSES``)
whose ``forward`` calls the family's adapter, with timm's signature (TorchScript compiles it;
blocks pass the second argument by keyword). The subclass adds no state, so that
``copy.deepcopy``, ``torch.save`` / ``torch.load`` and ``state_dict`` round trips work and
unpatching (timm's class back) restores timm's forward exactly. ``patching.model`` says why a
subclass and not a wrapper, and re-exports these names (pickles made before they moved here
name that module).

A Swin-family block holding a patched module as ``.attn`` gets a subclass the same way
(``FlashSwinTransformerBlock``, ...; ``PATCHED_BLOCK_CLASSES``), whose window method has the
op read the windows from the feature map (``WindowAttentionAdapter.block_attention``) where
it can (``_feature_map_grid``), else runs timm's.
"""
from __future__ import annotations

import types
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .adapters import ADAPTERS, WindowAttentionAdapter
from ..ops.hooks import runs_hooks
from .tracing import register_fx_leaves, runs_timm

FAMILY_ATTR = "_flashwin_family"  # class attribute of the patched subclasses: the family
BLOCK_FAMILY_ATTR = "_flashwin_block_family"  # the same, of the patched block subclasses


def _renamed(function: Callable, name: str) -> Callable:
    """A copy of ``function`` under another ``__name__``: TorchScript compiles a method
    under its function's name, and a class's ``forward`` can name timm's only so."""
    copy = types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__, copy.__annotations__ = function.__kwdefaults__, dict(function.__annotations__)
    copy.__qualname__, copy.__module__, copy.__doc__ = name, function.__module__, function.__doc__
    return copy


def patched_class(adapter: WindowAttentionAdapter, name: str) -> type:
    timm_class = adapter.module_type()
    timm_forward = timm_class.forward

    # timm's signature, which TorchScript compiles: torch.jit.is_scripting() is resolved
    # when it compiles, so that only the first branch is compiled (timm's forward); the
    # rest must only parse (no *args, **kwargs). tracing.py says what each tool gets.
    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x, mask)
        if runs_timm(x):
            return timm_forward(self, x, mask)
        return adapter.forward(self, x, mask)

    # the same under MaxViT's name of the second argument (its blocks pass it by keyword)
    def forward_shared_rel_pos(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None):
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x, shared_rel_pos)
        if runs_timm(x):
            return timm_forward(self, x, shared_rel_pos)
        return adapter.forward(self, x, shared_rel_pos)

    # BEiT's Attention: x and the model's shared relative-position bias
    def forward_shared_rel_pos_bias(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None):
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x, shared_rel_pos_bias)
        if runs_timm(x):
            return timm_forward(self, x, shared_rel_pos_bias)
        return adapter.forward(self, x, shared_rel_pos_bias)

    # x alone (TinyViT, DaViT, NesT, Hiera; torchvision's Swin modules, x the block's map)
    def forward_x(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x)
        if runs_timm(x):
            return timm_forward(self, x)
        return adapter.forward(self, x)

    # Twins' LocallyGroupedAttn: x and its map's (H, W)
    def forward_size(self, x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x, size)
        if runs_timm(x):
            return timm_forward(self, x, size)
        return adapter.forward(self, x, size)

    # GCViT's WindowAttentionGlobal: x and its image's global query
    def forward_q_global(self, x: torch.Tensor, q_global: Optional[torch.Tensor] = None) -> torch.Tensor:
        if torch.jit.is_scripting():
            return self._flashwin_timm_forward(x, q_global)
        if runs_timm(x):
            return timm_forward(self, x, q_global)
        return adapter.forward(self, x, q_global)

    forwards = {"mask": forward, "shared_rel_pos": _renamed(forward_shared_rel_pos, "forward"),
                None: _renamed(forward_x, "forward"), "size": _renamed(forward_size, "forward"),
                "q_global": _renamed(forward_q_global, "forward"),
                "shared_rel_pos_bias": _renamed(forward_shared_rel_pos_bias, "forward")}

    def extra_repr(self) -> str:
        text = timm_class.extra_repr(self)
        return f"{text}, flashwin={adapter.family}" if text else f"flashwin={adapter.family}"

    return type(name, (timm_class,), {
        "forward": forwards[adapter.forward_arg],
        "_flashwin_timm_forward": _renamed(timm_forward, "_flashwin_timm_forward"),
        "extra_repr": extra_repr, FAMILY_ATTR: adapter.family,
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{timm_class.__module__.partition('.')[0]}'s {timm_class.__module__}.{timm_class.__qualname__}, "
                   "patched by timm_flashwin.",
    })


def patched_block_class(adapter: WindowAttentionAdapter, name: str) -> type:
    timm_class = adapter.block_type()
    timm_method = getattr(timm_class, adapter.block_method)

    def window_attention(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # as the module's forward
            return self._flashwin_timm_window_attention(x)
        grid = _feature_map_grid(self, adapter, x)
        if grid is None:
            return timm_method(self, x)
        return adapter.block_attention(self, x, grid)

    window_attention.__name__ = window_attention.__qualname__ = adapter.block_method
    window_attention.__doc__ = (f"timm's {adapter.block_method}, with the op reading the windows from the map "
                                "(``WindowAttentionAdapter.block_attention``) where it can.")
    return type(name, (timm_class,), {
        adapter.block_method: window_attention,
        "_flashwin_timm_window_attention": _renamed(timm_method, "_flashwin_timm_window_attention"),
        BLOCK_FAMILY_ATTR: adapter.family,
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"timm's {timm_class.__module__}.{timm_class.__qualname__}, its windows read in place by "
                   "timm_flashwin.",
    })


def _feature_map_grid(block: nn.Module, adapter: WindowAttentionAdapter, x: torch.Tensor):
    """The block's window grid where its patched module's attention can run on the map
    (``adapter.block_grid``), else None: the module not patched (filtered out, unpatched),
    torch.compile tracing, a tool that runs timm's code (``tracing.runs_timm``), hooks on
    the module that calling it would run."""
    attn = getattr(block, "attn", None)
    if (type(attn) is not PATCHED_CLASSES[adapter.family] or torch.compiler.is_compiling() or runs_timm(x)
            or runs_hooks(attn)):
        return None
    return adapter.block_grid(block, x)


#: family -> the class patched instances take (module-level names, so that pickle finds them)
PATCHED_CLASSES: Dict[str, type] = {}
for _family, _name in (("swin", "FlashSwinWindowAttention"), ("swinv2", "FlashSwinV2WindowAttention"),
                       ("swinv2_cr", "FlashSwinV2CrWindowMultiHeadAttention"),
                       ("maxxvit", "FlashMaxxVitAttentionCl"), ("maxxvit_2d", "FlashMaxxVitAttention2d"),
                       ("tiny_vit", "FlashTinyVitAttention"), ("davit", "FlashDaVitWindowAttention"),
                       ("twins", "FlashTwinsLocallyGroupedAttn"), ("nest", "FlashNestAttention"),
                       ("hiera", "FlashHieraMaskUnitAttention"), ("gcvit", "FlashGcVitWindowAttentionGlobal"),
                       ("samvit", "FlashSamVitAttention"),
                       ("beit", "FlashTimmBeitAttention"), ("tv_swin", "FlashTvShiftedWindowAttention"),
                       ("tv_swinv2", "FlashTvShiftedWindowAttentionV2"),
                       ("tv_swin3d", "FlashTvShiftedWindowAttention3d")):
    if ADAPTERS[_family].module_type() is not None:  # torchvision's, where it is installed
        PATCHED_CLASSES[_family] = globals()[_name] = patched_class(ADAPTERS[_family], _name)


register_fx_leaves(PATCHED_CLASSES.values())

#: family -> the class the block holding a patched module takes (``adapter.block_type``)
PATCHED_BLOCK_CLASSES: Dict[str, type] = {}
for _family, _name in (("swin", "FlashSwinTransformerBlock"), ("swinv2", "FlashSwinTransformerV2Block"),
                       ("swinv2_cr", "FlashSwinTransformerV2CrBlock"), ("maxxvit", "FlashMaxxVitPartitionAttentionCl")):
    PATCHED_BLOCK_CLASSES[_family] = globals()[_name] = patched_block_class(ADAPTERS[_family], _name)
