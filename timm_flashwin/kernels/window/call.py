"""One window-attention call, described once: ``WindowCall`` (what the plans are made from and
kept by, and the host programs' key), the tensors the kernels read beside it
(``WindowTensors``) and what the forward saves for the backward (``WindowSaved``).

The op (``ops.window``) makes a call's description once, after its checks, and every layer
below reads it by name. Plans (``plan``) are made from the description alone and kept by it:
whatever changes a plan or a launch is a field of it, the process-wide settings included
(``Settings``), so that a setting changed after a shape was seen is a new call, with new
plans and a new host program. NamedTuples: the eager road is host-bound, and a tuple of plain
values is the cheapest hashable record.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .. import fast_launch
from ..arch import Arch
from . import config
from .layout import FeatureMap

#: How the bias term reaches the kernels: none; a dense (H, N, N) tensor; a table (T, H) read
#: through an (N, N) index of its rows (``TableBias``); the host's float16 copy of the bias
#: times log2(e), an (H, N, N) slice per mask window that may hold the mask too (the kernels
#: that stream key blocks, 16-bit inputs: ``bias_mask.streamed_bias``). A call's ``bias`` is
#: one of the first three, as it was handed; its plans say what each kernel reads
#: (``plan.ForwardPlan.bias``), which ``bias_mask_tiles.bias_tile`` adds.
NO_BIAS, DENSE_BIAS, TABLE_BIAS, LOG2E_COPY = 0, 1, 2, 3

#: Where the kernels read a window's queries (the kernels' GLOBAL_QUERY, ``tiles.query_base``):
#: in qkv; in a tensor of one query per image, window b taking image b // (B_ / B) or b % B.
OWN_QUERY, IMAGE_MAJOR_QUERY, TILED_QUERY = 0, 1, 2


class Settings(NamedTuple):
    """The process-wide settings that change a call's plans or launches (``settings()``)."""

    #: ``config.MASK_REGIONS``
    mask_regions: bool
    #: ``config.FOLDED_MASK_MAX_BYTES``
    folded_mask_max_bytes: int
    #: ``config.MIN_WINDOWS_PER_PROGRAM``
    min_windows_per_program: int
    #: ``torch.use_deterministic_algorithms``: no atomic adds in the backward
    deterministic: bool
    #: direct launches (``fast_launch``) and the Triton settings their compiled kernels keep, None
    #: where they are off
    launches: Optional[Tuple]


def settings() -> Settings:
    """The settings as they are now, read once per call."""
    return Settings(config.MASK_REGIONS, config.FOLDED_MASK_MAX_BYTES, config.MIN_WINDOWS_PER_PROGRAM,
                    torch.are_deterministic_algorithms_enabled(),
                    fast_launch._settings_key() if fast_launch.ENABLED else None)


class WindowCall(NamedTuple):
    """Every static property of one ``window_attention`` call: its shapes, dtype, device
    architecture, the bias's and the mask's kinds, the scores' kind, dropout, the layouts
    and the settings. The tensors' addresses and strides are no part of it (they are launch
    arguments: ``WindowTensors``)."""

    #: B_, windows (with ``grid``: images * grid.num_windows)
    windows: int
    #: N, tokens per window
    tokens: int
    #: H
    heads: int
    #: D
    head_dim: int
    dtype: torch.dtype
    #: the limits of the tensors' device (``arch.tensor_arch``)
    arch: Arch
    #: NO_BIAS, DENSE_BIAS or TABLE_BIAS, as handed to the op
    bias: int
    #: a TABLE_BIAS's sigmoid scale (SwinV2's 16), 0.0 for none
    sigmoid: float
    #: the mask's nW, 0 without a mask
    periods: int
    #: cosine attention (a logit scale), else V1's ``scale``
    cosine: bool
    #: V1's score scale (1.0 for cosine attention)
    scale: float
    dropout_p: float
    #: whether a backward may follow (the forward then saves what it needs)
    save_stats: bool
    #: the feature-map layout qkv is read in, None for partitioned windows
    grid: Optional[FeatureMap]
    #: OWN_QUERY, IMAGE_MAJOR_QUERY or TILED_QUERY
    query: int
    settings: Settings

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0


class WindowTensors(NamedTuple):
    """The tensors of one call, as the kernels read them (None where absent)."""

    #: (B_, N, 3*H*D) or a (B_, N, 3, H, D) view of any strides; with ``query`` (B_, N, 2, H, D)
    #: keys and values; with ``grid`` the feature map's (B, H*W, 3*H*D)
    qkv: torch.Tensor
    #: (B, N, H*D): the queries an image's windows share (GCViT's global query)
    query: Optional[torch.Tensor]
    #: the dense bias (H, N, N), or with TABLE_BIAS its table (T, H)
    bias: Optional[torch.Tensor]
    #: (nW, N, N)
    mask: Optional[torch.Tensor]
    #: (H,), contiguous: the kernels clamp and exponentiate it
    logit_scale: Optional[torch.Tensor]
    #: (1,) int64, with dropout (``ops.dropout_seed``)
    seed: Optional[torch.Tensor]
    #: TABLE_BIAS: the (N, N) table rows of each token pair, and the pairs sorted by table row
    #: (order (N*N,), offsets (T + 1,): ``position_bias.TableRows``) for the table's gradient
    index: Optional[torch.Tensor]
    order: Optional[torch.Tensor]
    offsets: Optional[torch.Tensor]


class ForwardOutputs(NamedTuple):
    """What the forward kernels write: the output, the softmax statistics the backward
    reads (``plan.CallPlan.stats_shape``; empty where none are saved) and the mask's region
    ids and info (``bias_mask.mask_structure``; empty where unused)."""

    out: torch.Tensor
    stats: torch.Tensor
    regions: torch.Tensor
    mask_info: torch.Tensor


class WindowSaved(NamedTuple):
    """What the forward saves for the backward, by name: the call's tensors as the kernels
    read them, the forward's outputs, and two tensors of the eager road's: the table where
    the bias read is its gathered form and a sigmoid's derivative needs it, and the float16
    bias copy the forward kept (saved for a host program's recording, ``ops.host_program``).
    The table's rows come last: the eager road keeps them as attributes (an index may be an
    inference tensor, which autograd cannot save), the registered operators save them."""

    qkv: torch.Tensor
    query: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    logit_scale: Optional[torch.Tensor]
    seed: Optional[torch.Tensor]
    out: torch.Tensor
    stats: torch.Tensor
    regions: torch.Tensor
    mask_info: torch.Tensor
    table: Optional[torch.Tensor]
    bias_copy: Optional[torch.Tensor]
    index: Optional[torch.Tensor]
    order: Optional[torch.Tensor]
    offsets: Optional[torch.Tensor]
