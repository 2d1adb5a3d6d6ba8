"""timm.layers' relative-position bias modules as ``window_attention`` takes their bias.

``timm.layers.pos_embed_rel`` holds three, which MaxViT, MaxxViT and CoAtNet attach to their
attention modules as ``rel_pos``; each one's ``get_bias()`` is the dense (1, H, N, N) bias
that timm adds to the scores. Handed to the op:

- ``RelPosBias``: a table ((2Wh-1)(2Ww-1), H) gathered by relative_position_index, Swin
  V1's bias: ``TableBias(table, index)``.
- ``RelPosBiasTf``: a table (H, 2Wh-1, 2Ww-1) whose rows two one-hot einsums pick
  (height_lookup, width_lookup): where the kernels take the table, ``TableBias`` of the
  table as a (T, H) view and the rows the lookups pick (under torch.compile constants of
  the graph); under torch.export and dispatch modes ``get_bias()``.
- ``RelPosMlp``: its Mlp on the log-spaced offsets, gathered by the index (mode "swin": 16
  sigmoid of it): where the kernels take the tensors and the Mlp is timm's,
  ``TableBias(position_mlp_table(...), index, sigmoid_scale)``, its dropout drawn as timm's
  layer draws it; elsewhere ``get_bias()``.

A (N, N) view of a flat index, and the rows the TF lookups pick, are kept on the attention
module (``KEPT_ATTR``) while the tensors they come from are unchanged, so that the op's
sorted pairs of an index (kept on the index tensor) are computed once.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
from torch import nn

from ...ops.dispatch import dispatch_free, no_dispatch_mode, uses_kernels
from ...ops.position_bias import TableBias
from ...ops.position_mlp import fusable_meta_mlp, meta_mlp_dropout_mask, position_mlp_table
from ...ops.dispatch import exporting
from .base import inference_cache

#: instance attribute of a patched module: {name: (key, value)} of what ``_kept`` keeps
KEPT_ATTR = "_flashwin_kept"


def _rel_pos_classes() -> Tuple[type, type, type]:
    from timm.layers.pos_embed_rel import RelPosBias, RelPosBiasTf, RelPosMlp
    return RelPosBias, RelPosBiasTf, RelPosMlp


def unsupported_rel_pos(rel_pos: Optional[nn.Module]) -> Optional[str]:
    """Why the op cannot take this ``rel_pos``'s bias, or None (None: no bias)."""
    if rel_pos is None or type(rel_pos) in _rel_pos_classes():
        return None
    return (f"rel_pos is a {type(rel_pos).__name__}, not one of timm's RelPosBias, RelPosBiasTf, RelPosMlp: "
            "its bias is not known")


def rel_pos_window(rel_pos: nn.Module) -> Tuple[int, int]:
    """The (height, width) window the bias is for."""
    return tuple(rel_pos.window_size)


def rel_pos_tokens(rel_pos: nn.Module) -> int:
    """N of the (N, N) bias: the window's tokens and any prefix (class) tokens."""
    window = rel_pos_window(rel_pos)
    return window[0] * window[1] + getattr(rel_pos, "prefix_tokens", 0)


def _kept(module: nn.Module, name: str, sources: Tuple[torch.Tensor, ...], compute: Callable):
    """``compute()``, kept on ``module`` while every source tensor is the same object with the
    same storage, shape and version (eager mode; under torch.compile computed in the graph,
    under dispatch modes at every call: ``no_dispatch_mode``).

    Sources made under torch.inference_mode have no version counter: their value is computed
    at every call. From other sources it is computed outside inference mode, so that what is
    kept has a version too (``inference_cache`` keys on it) and can serve a later training
    step (an inference tensor cannot be saved for backward)."""
    if not no_dispatch_mode() or any(t.is_inference() for t in sources):
        return compute()
    key = tuple((id(t), t.data_ptr(), t.shape, t._version) for t in sources)
    kept = module.__dict__.setdefault(KEPT_ATTR, {})
    entry = kept.get(name)
    if entry is None or entry[0] != key:
        with torch.inference_mode(False):
            entry = kept[name] = (key, compute(), sources)  # the sources held: their ids stay theirs
    return entry[1]


def _square_index(module: nn.Module, index: torch.Tensor) -> torch.Tensor:
    """A flat (N*N,) relative_position_index as the (N, N) view ``TableBias`` takes, the same
    view object at every call while the index is unchanged."""
    n = math.isqrt(index.numel())
    return _kept(module, "index", (index,), lambda: index.view(n, n))


def _one_hot_rows(height: torch.Tensor, width: torch.Tensor) -> Optional[torch.Tensor]:
    """The (N, N) rows of RelPosBiasTf's table flattened to (H, (2Wh-1)(2Ww-1)) that its two
    einsums pick from the lookups ``height`` (Wh, Wh, 2Wh-1) and ``width`` (Ww, Ww, 2Ww-1):
    query (i, j) and key (x, y) read row hv[i, x] * (2Ww-1) + wv[j, y], hv and wv the hot
    columns of height[i, x] and width[j, y]. None where a lookup row is not one-hot (then
    the einsum is no gather)."""
    for lookup in (height, width):
        if not (((lookup == 0) | (lookup == 1)).all() and (lookup.sum(-1) == 1).all()):
            return None
    hv, wv = height.argmax(-1), width.argmax(-1)
    rows = hv[:, None, :, None] * width.shape[-1] + wv[None, :, None, :]  # (Wh, Ww, Wh, Ww)
    n = hv.shape[0] * wv.shape[0]
    return rows.reshape(n, n)


@torch.compiler.assume_constant_result
def _traced_one_hot_rows(height: torch.Tensor, width: torch.Tensor) -> Tuple[Optional[torch.Tensor]]:
    """``(_one_hot_rows(height, width),)`` as a constant of a graph torch.compile traces:
    dynamo calls it with the lookups' values (the module's buffers, which timm computes from
    the window size) when it traces, so that the graph neither checks them (a
    data-dependent ``.all()``) nor computes the rows in every step. A tuple: dynamo gives
    a tuple constant a name of its own in each call, a lone tensor the function's name,
    which the second call in a graph shares (torch 2.14: AOTAutograd then stops, "source
    ... already in seen_sources")."""
    return (_one_hot_rows(height, width),)


def _tf_rows(module: nn.Module, rel_pos: nn.Module) -> Optional[torch.Tensor]:
    """``_one_hot_rows`` of RelPosBiasTf's lookups: kept on ``module`` in eager mode,
    constants of the graph under torch.compile; None under torch.export and dispatch modes
    (FakeTensorMode, ...), where the lookups' values cannot be read."""
    height, width = rel_pos.height_lookup, rel_pos.width_lookup
    if torch.compiler.is_compiling():
        if exporting():
            return None
        # viewed with the lookups' static sizes: compiled with dynamic=True, dynamo gives the
        # constant symbolic sizes, whose shape it cannot then read as a tuple (torch 2.14)
        n = height.shape[0] * width.shape[0]
        return _traced_one_hot_rows(height, width)[0].view(n, n)
    if not dispatch_free(height):
        return None
    return _kept(module, "tf_rows", (height, width), lambda: _one_hot_rows(height, width))


def rel_pos_bias(module: nn.Module, rel_pos: nn.Module) -> Union[TableBias, torch.Tensor]:
    """The bias of ``rel_pos`` (one of ``unsupported_rel_pos``'s served classes) held by the
    attention module ``module``, as ``window_attention`` takes it (the module docstring's table)."""
    rel_pos_bias_cls, rel_pos_tf_cls, _ = _rel_pos_classes()
    constant = not exporting()
    kind = type(rel_pos)
    if kind is rel_pos_bias_cls:
        table, index = rel_pos.relative_position_bias_table, rel_pos.relative_position_index
        return inference_cache(module, (table, index),
                               lambda: TableBias(table, _square_index(module, index), constant_index=constant))
    if kind is rel_pos_tf_cls:
        table = rel_pos.relative_position_bias_table
        rows = _tf_rows(module, rel_pos) if uses_kernels(table) else None
        if rows is None:
            return inference_cache(module, (table, rel_pos.height_lookup, rel_pos.width_lookup), rel_pos.get_bias)
        return inference_cache(module, (table, rows),
                               lambda: TableBias(table.flatten(1).t(), rows, constant_index=constant))
    return _mlp_bias(module, rel_pos)


def _mlp_bias(module: nn.Module, rel_pos: nn.Module) -> Union[TableBias, torch.Tensor]:
    """RelPosMlp's bias: its table computed by ``position_mlp_table`` (one kernel each way)
    where the kernels take the tensors, the Mlp is timm's (``fusable_meta_mlp``) and its
    activation is nothing (mode "cr") or 16 sigmoid (mode "swin"); else ``get_bias()``."""
    mlp, coords, index = rel_pos.mlp, rel_pos.rel_coords_log, rel_pos.relative_position_index
    act, gain = type(rel_pos.bias_act), rel_pos.bias_gain
    plain, sigmoid = act is nn.Identity and gain is None, act is nn.Sigmoid and bool(gain)
    sources = tuple(t for t in (coords, index, *mlp.parameters()) if t is not None)
    if (not (plain or sigmoid) or rel_pos.prefix_tokens or index is None or not uses_kernels(coords)
            or not fusable_meta_mlp(mlp)):
        return inference_cache(module, sources, rel_pos.get_bias)
    sigmoid_scale = float(gain) if sigmoid else None

    def compute() -> TableBias:
        flat = coords.view(-1, 2)
        table = position_mlp_table(flat, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias,
                                   dropout_mask=meta_mlp_dropout_mask(mlp, flat), dropout_p=mlp.drop1.p)
        return TableBias(table, _square_index(module, index), sigmoid_scale=sigmoid_scale,
                         constant_index=not exporting())

    return inference_cache(module, sources, compute)
