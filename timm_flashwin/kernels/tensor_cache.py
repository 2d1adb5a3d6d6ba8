"""Values derived from a tensor, kept on the tensor until it changes.

The op derives things from tensors that are the same in every call of a model (timm's
shift masks and bias tables are buffers or parameters): the float16 bias copy, the
mask's region structure, a position-bias index's pairs sorted by table row. ``kept_on``
keeps such a value in the tensor's ``__dict__`` and computes it again only when the
tensor's version counter (in-place changes), storage, shape or strides, or a caller's
extra key, differ.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def kept_on(tensor: torch.Tensor, name: str, compute: Callable[[], Any], *key: Any) -> Any:
    """``compute()``, kept on ``tensor`` (in its ``__dict__`` under ``name``) and computed
    again when the tensor's version counter (in-place changes), storage, shape or strides,
    or ``key``, differ from those it was computed for. Inference tensors (made under
    torch.inference_mode) have no version counter: for them it is computed every call."""
    if tensor.is_inference():
        return compute()
    value = kept(tensor, name, *key)
    if value is None:
        # computed outside inference mode: a value kept by a call under torch.inference_mode
        # serves later training calls too, which may save it for the backward (an inference
        # tensor cannot be: the mask's region ids, saved by the op's forward)
        with torch.inference_mode(False):
            value = compute()
        tensor.__dict__[name] = (_kept_key(tensor, key), value)
    return value


def kept(tensor: torch.Tensor, name: str, *key: Any) -> Optional[Any]:
    """What ``kept_on`` keeps on ``tensor`` under ``name`` for the tensor's present state
    (version, storage, shape, strides, ``key``), or None; computes nothing."""
    if tensor.is_inference():
        return None
    entry = tensor.__dict__.get(name)
    return entry[1] if entry is not None and entry[0] == _kept_key(tensor, key) else None


def _kept_key(tensor: torch.Tensor, key: tuple) -> tuple:
    """What a kept value was computed for: the tensor's version, storage, shape, strides, ``key``."""
    return (tensor._version, tensor.data_ptr(), tensor.shape, tensor.stride(), *key)
