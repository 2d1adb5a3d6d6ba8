"""What every family adapter shares: the checks made at patch time, the forward skeleton
(qkv -> window_attention -> proj) that reads the module's own tensors at call time, and
the same on the block's unpartitioned feature map (``block_attention``)."""
from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...ops.dispatch import no_dispatch_mode
from ...ops.window import window_attention
from ...ops.window_checks import MAX_HEAD_DIM, MAX_TOKENS
from ...ops.position_bias import TableBias
from ...ops.window_grid import WindowGrid

#: instance attribute of a patched module whose training forward recomputes its qkv
#: projection in the backward (``patch_model(..., recompute_qkv=True)``)
RECOMPUTE_QKV_ATTR = "_flashwin_recompute_qkv"
#: instance attribute of a block: ((H, W, *its partition attributes), its WindowGrid or None), ``block_grid``
BLOCK_GRID_ATTR = "_flashwin_grid"


class WindowAttentionAdapter:
    """Routes one timm window-attention class through ``window_attention``.

    Subclasses name the class they serve and say how to get its qkv, its position bias
    and its score scale; nothing is copied out of the module, so optimizer steps,
    load_state_dict, in-place edits, ``.to()`` and set_input_size() all take effect.
    """

    #: short name used in reports: "swin", "swinv2", "swinv2_cr", "maxxvit", "tiny_vit", ...
    family: str = ""
    #: the model family ``timm-flashwin list`` and the README name, where it is not ``family``
    #: (MaxxViT's channels-first modules, "maxxvit_2d", are of the "maxxvit" family)
    model_family: str = ""
    #: attributes the forward reads; a timm version without them is not patched
    required: Sequence[str] = ()
    #: the name of the second argument of timm's forward, None where it takes x alone (the
    #: patched forward keeps timm's signature: blocks pass it by keyword, TorchScript compiles
    #: it; ``patching.classes.patched_class`` has one forward per name)
    forward_arg: Optional[str] = "mask"
    #: the method of the family's block (``block_type``) that rolls, partitions, calls the
    #: module, merges and rolls back; ``block_attention`` does its work on the feature map
    block_method: str = "_attn"
    #: block attributes ``block_attention`` reads; a block without them keeps timm's method
    block_required: Sequence[str] = ("attn", "window_size", "shift_size", "attn_mask")

    @staticmethod
    def module_type() -> Type[nn.Module]:
        raise NotImplementedError

    @staticmethod
    def block_type() -> Optional[Type[nn.Module]]:
        """timm's block class that holds the module as ``.attn`` and whose ``block_method``
        ``block_attention`` replaces; None where no block's windows are read from its map."""
        return None

    # -- geometry ---------------------------------------------------------------------
    def window_size(self, module: nn.Module) -> Optional[Tuple[int, ...]]:
        """The module's window (tokens = its product; (T, H, W) for video windows); None where
        any number of tokens comes (the op checks it at call time)."""
        return tuple(module.window_size)

    def num_heads(self, module: nn.Module) -> int:
        return module.num_heads

    def head_dim(self, module: nn.Module) -> int:
        return module.qkv.out_features // (3 * module.num_heads)

    def attn_drop(self, module: nn.Module) -> float:
        return float(module.attn_drop.p)

    def in_features(self, module: nn.Module) -> int:
        """C, the channels of the module's input."""
        return module.qkv.in_features

    # -- what the forward computes ----------------------------------------------------
    def qkv(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module.qkv(x)

    def position_bias(self, module: nn.Module) -> Union[TableBias, torch.Tensor, None]:
        """The bias as ``window_attention`` takes it: (1, H, N, N) / (H, N, N), or a
        ``TableBias`` that the op gathers itself; None: no bias."""
        raise NotImplementedError

    def score_scale(self, module: nn.Module) -> Dict:
        """``scale=`` (V1) or ``logit_scale=`` (cosine) for window_attention."""
        raise NotImplementedError

    # -- patch time -------------------------------------------------------------------
    def unsupported(self, module: nn.Module) -> Optional[str]:
        """Why this module cannot be served, or None."""
        missing = [name for name in self.required if not hasattr(module, name)]
        if missing:
            import timm
            return f"timm {timm.__version__}: the module has no {', '.join(missing)}"
        head_dim = self.head_dim(module)
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} is not in [1, {MAX_HEAD_DIM}]"
        window = self.window_size(module)
        if window is not None and math.prod(window) > MAX_TOKENS:
            return (f"window {'x'.join(map(str, window))} has {math.prod(window)} tokens, "
                    f"more than {MAX_TOKENS}")
        if not 0.0 <= self.attn_drop(module) < 1.0:
            return f"attn_drop={self.attn_drop(module)} is not in [0, 1)"
        return None

    def describe(self, module: nn.Module, parent: Optional[nn.Module]) -> Optional[str]:
        """What the module attends, for the report, where the family has more than one kind
        (``parent``: the module holding it); None here."""
        return None

    # -- call time --------------------------------------------------------------------
    def forward(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replacement of the module's forward: x (B_, N, C) -> (B_, N, C)."""
        win_h, win_w = self.window_size(module)
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{type(module).__name__}: expected x of shape (num_windows*B, N, C), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[1] != win_h * win_w:
            raise ValueError(f"{type(module).__name__}: expected N = {win_h}*{win_w} = {win_h * win_w} tokens per "
                             f"window, got {x.shape[1]} (x of shape {tuple(x.shape)})")
        in_features = self.in_features(module)
        if x.shape[2] != in_features:
            raise ValueError(f"{type(module).__name__}: expected C = {in_features} channels, got {x.shape[2]} "
                             f"(x of shape {tuple(x.shape)})")
        return self._project(module, x, mask)

    #: the block attributes that, with the map's height and width, decide its grid
    #: (``block_grid``'s key; timm's blocks hold them as plain attributes)
    block_partition: Sequence[str] = ("window_size", "shift_size")

    def block_grid(self, block: nn.Module, x: torch.Tensor) -> Optional[WindowGrid]:
        """How ``block`` cuts x (B, H, W, C) into windows (``new_grid``), or None where the op
        cannot read them from the map, or the block lacks an attribute read. Kept on the
        block for its present map size and ``block_partition`` attributes (this runs per
        block and step: 10 us to compute on a CPU)."""
        if x.dim() != 4:
            return None
        key = (x.shape[1], x.shape[2], *(block.__dict__.get(name) for name in self.block_partition))
        kept = block.__dict__.get(BLOCK_GRID_ATTR)
        if kept is not None and kept[0] == key:
            return kept[1]
        if any(not hasattr(block, name) for name in self.block_required) or None in key:
            return None
        grid = self.new_grid(block, *key)
        block.__dict__[BLOCK_GRID_ATTR] = (key, grid)
        return grid

    def new_grid(self, block: nn.Module, height: int, width: int, window, shift) -> Optional[WindowGrid]:
        """A Swin block's shifted windows of the (height, width) map, or None: H or W not a
        multiple of the window (timm pads, and its padded tokens take part in the
        attention), a block window other than its module's, a shift out of range."""
        window, shift = tuple(window), tuple(shift)
        if (window != tuple(self.window_size(block.attn)) or height % window[0] or width % window[1]
                or not all(0 <= s < w for s, w in zip(shift, window))):
            return None
        return WindowGrid(height, width, window, shift)

    def block_attention(self, block: nn.Module, x: torch.Tensor, grid: WindowGrid) -> torch.Tensor:
        """Replacement of the block's window method (``block_method``) where ``block_grid``
        gives a grid: x (B, H, W, C) -> (B, H, W, C), what timm's roll, partition, attention
        module, merge and roll back give, with the op reading each window's rows of the qkv
        projection of the map where they lie (``window_attention(..., grid=)``) and writing
        its output there: no copies of the map around the attention."""
        batch, height, width, channels = x.shape
        out = self._project(block.attn, x.reshape(batch, height * width, channels), self.block_mask(block, x), grid)
        return out.view(batch, height, width, out.shape[-1])

    def block_mask(self, block: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The mask ``block`` hands its module for the map x: a Swin block's shift mask."""
        return block.get_attn_mask(x) if getattr(block, "dynamic_mask", False) else block.attn_mask

    def proj_input(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the module's proj takes, from the op's output (B_, N, H*D) for the input x."""
        return out

    def _project(self, module: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor],
                 grid: Optional[WindowGrid] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B_, N, C), or (B, H*W, C) on the feature map with ``grid`` -> the proj output,
        of the same shape (``proj_input``'s). ``bias``: one given with the call (MaxViT's
        shared_rel_pos), else the module's own (``position_bias``)."""
        # attn_drop is read at call time too: nn.Dropout's p, active in training mode only
        dropout_p = self.attn_drop(module) if module.training else 0.0
        if bias is None:
            bias = self.position_bias(module)
        # getattr, not __dict__: torch.compile guards on the attribute it reads, and recompiles when
        # patch_model changes it
        if getattr(module, RECOMPUTE_QKV_ATTR, False) and torch.is_grad_enabled():
            # gathered here: inside the checkpoint, under its dispatch mode, the op would
            # gather it anyway (the eager path's own gather needs no dispatch mode), and
            # again in the recomputation
            if isinstance(bias, TableBias):
                bias = bias.dense()
            out = checkpoint(self._attention, module, x, bias, mask, dropout_p, grid, use_reentrant=False,
                             context_fn=_save_attention_outputs)
        else:
            out = self._attention(module, x, bias, mask, dropout_p, grid)
        return self.project(module, self.proj_input(module, out, x))

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """The module's output projection of ``y`` (the proj input, ``proj_input``'s), and its
        dropout where the module has one."""
        return module.proj_drop(module.proj(y))

    def _attention(self, module: nn.Module, x: torch.Tensor, bias: Union[TableBias, torch.Tensor],
                   mask: Optional[torch.Tensor], dropout_p: float, grid: Optional[WindowGrid] = None) -> torch.Tensor:
        """x (B_, N, C) (or (B, H*W, C) with ``grid``) -> the proj input, of the same shape:
        the qkv projection and the op."""
        return window_attention(self.qkv(module, x), self.num_heads(module), bias=bias, mask=mask,
                                dropout_p=dropout_p, grid=grid, **self.score_scale(module))


class UnbiasedAdapter(WindowAttentionAdapter):
    """Modules that compute softmax(scale * Q K^T) V with the module's ``scale`` and no bias
    (DaViT, Twins, NesT, Hiera)."""

    def position_bias(self, module: nn.Module) -> None:
        return None

    def score_scale(self, module: nn.Module) -> Dict:
        return dict(scale=float(module.scale))


class WithoutDropout:
    """A mixin for adapters of modules with neither attn_drop nor proj_drop (TinyViT, DaViT,
    Hiera): placed before the adapter class among the bases."""

    def attn_drop(self, module: nn.Module) -> float:
        return 0.0

    def project(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return module.proj(y)


def _keep_attention_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing of ``_attention``: the op's outputs are kept (the backward
    reads out and the softmax statistics; rerunning the forward kernel would cost more than
    it saves), every other op, the qkv projection, is recomputed in the backward. The qkv
    activations (3 C per token, the largest tensor the op's backward reads) are then not
    kept between the passes."""
    ops = torch.ops.timm_flashwin
    if op in (ops.window_attention_fwd.default, ops.local_attention_fwd.default):  # Hiera's pooling blocks: local
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_save_attention_outputs = functools.partial(create_selective_checkpoint_contexts, _keep_attention_outputs)


def inference_cache(module: nn.Module, sources: Sequence[torch.Tensor], compute: Callable[[], torch.Tensor]):
    """``compute()``, reused across calls while nothing it reads can have changed; a
    ``TableBias`` is kept gathered (``dense()``), the (H, N, N) bias the kernels read.

    Only in inference (no autograd recording, module in eval mode) in plain eager mode (not
    under torch.compile, which fuses the computation anyway, nor a dispatch mode:
    ``no_dispatch_mode``). The key holds the identity,
    storage and version counter of every source tensor (optimizer steps, in-place
    edits and load_state_dict bump versions; ``.to()`` and set_input_size() make new
    tensors) and the autocast state, which decides the result's dtype. Sources made under
    torch.inference_mode (a model built there) have no version counter: nothing is reused.
    """
    if (module.training or torch.is_grad_enabled() or not no_dispatch_mode()
            or any(t.is_inference() for t in sources)):
        return compute()
    device_type = sources[0].device.type
    autocast = torch.is_autocast_enabled(device_type) if device_type in ("cuda", "cpu") else False
    key = (autocast, torch.get_autocast_dtype(device_type) if autocast else None,
           tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device) for t in sources))
    cached = module.__dict__.get("_flashwin_bias_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute()
    if isinstance(value, TableBias):
        value = value.dense()
    module.__dict__["_flashwin_bias_cache"] = (key, value)
    return value
