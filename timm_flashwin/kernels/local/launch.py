"""Host side of the local-attention kernels: launch plans, output allocation, launches.

Written with torch operations and ``launch.launcher`` launches only, so that
``torch.library.triton_op`` traces them under torch.compile. The launch plan (tiles, warps,
stages) is decided once per (pass, head_dim, dtype, class of rows) and cached (``plan``):
B, S, the pattern and the scale are run-time arguments of the kernels (a new sequence length
or window never recompiles); B, H, S and the pattern only pick the class (``row_class``:
short rows, long rows, or wide rows in a large grid), which picks between plans.

A tensor a kernel writes goes to its launch under one parameter only, and an unused pointer
(the tile counts, outside tests) is None, never another argument. A traced launch is a
functional op that clones each argument the kernel may write and hands each clone back in
its argument's place; torch's analysis of the kernel counts every argument of a Triton
function whose results address a store as written. lse passed again as the forward's unused
tile counts came back as its never-written clone (opcheck's test_aot_dispatch_dynamic:
the outputs of eager mode and AOTDispatcher differed). Where a tensor is needed for an unused
pointer (the seed without dropout), ``launcher.unused_pointer`` gives it: q in a direct
launch, an empty tensor of its own in a traced one.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import budget
from ..arch import INTERPRET, Arch, tensor_arch
from ..launcher import compiler_options, launcher, traced_launch, unused_pointer
from .backward import local_attention_bwd_dkdv_kernel, local_attention_bwd_dq_kernel
from .forward import local_attention_fwd_kernel, local_dropout_factor_kernel
from ..sizes import cdiv, tile_side
from .tiles import IEEE, NATIVE, TF32X3

LOG2E = 1.0 / math.log(2.0)

#: (period, before, after, sink): ``local_reference.LocalPattern``'s numbers
Pattern = Tuple[int, int, int, int]


@dataclass(frozen=True)
class Plan:
    """One kernel's launch: BLOCK_M query rows and BLOCK_N key rows per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: the classes of rows a launch's plans depend on (``row_class``)
SHORT, LONG, TALL = "short", "long", "tall"

#: ("fwd" | "dkdv" | "dq", head_dim, dtype, row class) -> Plan, consulted before the defaults
#: (benchmarks/bench_local.py --tune fills it to compare plans)
OVERRIDES: Dict[Tuple[str, int, torch.dtype, str], Plan] = {}

#: a query row that may see at least this many keys takes the long-row plans: taller query
#: tiles load each key tile for more rows, which pays where rows are long (global and causal
#: attention over long sequences); on windows the taller tile's masked edge costs more
LONG_ROW_KEYS = 8192


def _window_keys(pattern: Pattern, seq_len: int) -> int:
    """before + after of ``pattern``, an unlimited side counted as ``seq_len`` keys."""
    _period, before, after, _sink = pattern
    return (seq_len if before < 0 else before) + (seq_len if after < 0 else after)


def long_rows(pattern: Pattern, keys: int) -> bool:
    """Whether a query row of ``pattern`` over ``keys`` keys may see LONG_ROW_KEYS of them
    or more (the widest row: a block pattern's last query of a block, a causal row's last)."""
    period, _before, _after, sink = pattern
    return min(keys, _window_keys(pattern, keys) + period - 1 + sink) >= LONG_ROW_KEYS


#: the query rows of a TALL forward tile, and where it pays: the widest row sees at least
#: TALL_MIN_KEYS keys and the grid of tall tiles has at least TALL_MIN_PROGRAMS_PER_SM
#: programs per multiprocessor (``tall_tiles``)
TALL_BLOCK_M, TALL_MIN_KEYS, TALL_MIN_PROGRAMS_PER_SM = 128, 1024, 16


def tall_tiles(pattern: Pattern, queries: int, keys: int, batch_heads: int, sm_count: int) -> bool:
    """Whether the forward takes TALL_BLOCK_M query rows a tile: a taller tile loads each
    key tile for twice the rows, which pays where the grid has enough programs to keep every
    multiprocessor busy to the end and the rows are wide; it costs where a tile's rows see
    different keys (the masked edges of a narrow sliding window; frames that are not whole
    tiles, whose tile straddles two frames' key ranges). H100, bf16, head_dim 64, 4 rounds,
    2026-11-27 (128 x 64 tiles, 4 warps, 4 stages, against 64 x 64): 256-token frames,
    16-frame windows, S 32768 / 65536 -6% / -8%, 4-frame windows -4% / -5%, with a
    64-token sink -9% (S 65536); window (512, 512), B 4 x H 16, S 16384 -3%; causal S 4096
    with B 8 x H 16 -6%; but causal S 4096 with B 2 x H 16 (1024 tall programs) +4%, 16-frame
    windows at S 8192 (768) +8%, a sliding window of 500 +1% to +3% whatever the grid,
    1560-token frames +3% (``benchmarks/results/local_tall_tiles_ab_h100_91dffc8.json``)."""
    period = pattern[0]
    if period > 1 and period % TALL_BLOCK_M:
        return False
    width = min(keys, _window_keys(pattern, keys))
    programs = cdiv(queries, TALL_BLOCK_M) * batch_heads
    return width >= TALL_MIN_KEYS and programs >= TALL_MIN_PROGRAMS_PER_SM * sm_count


def row_class(pattern: Pattern, queries: int, keys: int, batch_heads: int, arch: Arch,
              dropout: bool = False) -> str:
    """The class of rows whose plans a launch takes: LONG (``long_rows``), else TALL
    (``tall_tiles``, on a GPU, without dropout), else SHORT. Only the forward at head_dim
    <= 64 has a TALL plan; the other kernels take their SHORT one there. Not with dropout:
    its random numbers take registers, and the sm_90 build of the tall forward with dropout
    spills 336 B per thread (16 B without; tests/local_arch_build.py), not timed."""
    if long_rows(pattern, keys):
        return LONG
    if not (INTERPRET or dropout) and tall_tiles(pattern, queries, keys, batch_heads, arch.sm_count):
        return TALL
    return SHORT


def plan(kind: str, head_dim: int, dtype: torch.dtype, rows: str = SHORT, queries: Optional[int] = None,
         keys: Optional[int] = None, arch: Optional[Arch] = None) -> Plan:
    """The launch of kernel ``kind`` ("fwd", "dq", "dkdv") for rows of class ``rows``
    (``row_class``) on ``arch`` (``arch.device_arch``; None: the tuned plan as it is,
    ``budget.local_fit``), its tiles fitted to ``queries`` and ``keys`` where given
    (``fitted``)."""
    found = OVERRIDES.get((kind, int(head_dim), dtype, rows))
    tiles = found if found is not None else _fitted_plan(kind, tile_side(head_dim), dtype, rows, arch)
    if queries is None:
        return tiles
    return fitted(tiles, tile_side(queries), tile_side(keys))


@functools.lru_cache(maxsize=None)
def _fitted_plan(kind: str, width: int, dtype: torch.dtype, rows: str, arch: Optional[Arch]) -> Plan:
    return budget.local_fit(kind, _default_plan(kind, width, dtype, rows), max(width, 16), dtype.itemsize, arch)


def fits(head_dim: int, dtype: torch.dtype, arch: Arch) -> bool:
    """Whether every kernel's plan, in every class of rows, fits ``arch`` (else PyTorch
    computes: float32 at head_dim above 128 on a 64 KB GPU)."""
    width = tile_side(head_dim)
    return all(_fitted_plan(kind, width, dtype, rows, arch) is not None
               for kind in ("fwd", "dq", "dkdv") for rows in (SHORT, LONG, TALL))


@functools.lru_cache(maxsize=None)
def fitted(tiles: Plan, queries: int, keys: int) -> Plan:
    """``tiles`` no taller than ``queries`` rows and no wider than ``keys`` (powers of two),
    and then with at most 4 warps: a short sequence's call (Hiera's pooling blocks: 4 or 16
    queries against 16 or 64 keys, head_dim 96) otherwise pads every tile with rows that
    hold nothing (the dq plan at head_dim 128 takes 128 rows). BLOCK_M is the query rows
    in every kernel, BLOCK_N the keys."""
    block_m, block_n = min(tiles.block_m, queries), min(tiles.block_n, keys)
    if (block_m, block_n) == (tiles.block_m, tiles.block_n):
        return tiles
    return Plan(block_m, block_n, min(tiles.num_warps, 4), tiles.num_stages)


#: (kind, padded head dim) -> (BLOCK_M, BLOCK_N, warps, stages) for 16-bit inputs on the GPU;
#: kind "dkdv" holds BLOCK_N keys per program and steps over BLOCK_M queries. head_dim 64 and
#: 128: the fastest plans on an H100 (bf16, ``bench_local.py --tune frames_w16:16384
#: sliding500:8192 window512_d128:16384``, 2026-11-26). Against the earlier plans (128 query
#: rows, 8 warps; ``bench_local.py --quick``): forward -10% to -25% but +7% on global
#: attention at head_dim 128 (128 rows suit its long rows of keys), forward+backward -27% to
#: -46%. 256: built, not timed. Rows of ``LONG_ROW_KEYS`` keys or more: ``_LONG_ROWS_16BIT``;
#: wide rows in a large grid: ``_TALL_TILES_16BIT``
_PLANS_16BIT = {
    ("fwd", 64): (64, 64, 4, 3), ("fwd", 128): (64, 64, 4, 3), ("fwd", 256): (64, 32, 8, 2),
    ("dq", 64): (64, 64, 4, 3), ("dq", 128): (128, 64, 8, 3), ("dq", 256): (64, 32, 8, 2),
    ("dkdv", 64): (64, 64, 4, 3), ("dkdv", 128): (32, 64, 4, 3), ("dkdv", 256): (32, 32, 8, 2),
}
#: the plans of ``_PLANS_16BIT`` that long rows replace (``LONG_ROW_KEYS``). Timed on an H200
#: (``bench_local.py --tune causal:16384 global_d128:16384 --tune-kinds fwd``, 2026-11-26):
#: causal at head_dim 64, 128 keys a tile: 3.18 -> 2.66 ms (128 x 64 with 8 warps: 3.17);
#: global at head_dim 128 kept 64 x 64 (4.22 ms; 128 x 128 with 8 warps 4.38, 128 x 64 4.61)
_LONG_ROWS_16BIT = {
    ("fwd", 64): (64, 128, 4, 3),
}
#: the plans of ``_PLANS_16BIT`` that TALL rows replace (``tall_tiles`` has the timings)
_TALL_TILES_16BIT = {
    ("fwd", 64): (TALL_BLOCK_M, 64, 4, 4),
}
_CLASS_PLANS_16BIT = {LONG: _LONG_ROWS_16BIT, TALL: _TALL_TILES_16BIT}
#: the same for float32 inputs (3xTF32 products, ``precision``). Not the dkdv kernel with 8
#: warps and 16 query rows at head_dim 65 to 128: triton 3.6 builds it into an illegal memory
#: access on an H100 (tests/test_local_attention_gpu.py::test_gpu_head_dims_and_dtypes with
#: float32 at head_dim 96 and 128); with 4 warps it runs and matches float64
_PLANS_32BIT = {
    ("fwd", 64): (64, 32, 8, 2), ("fwd", 128): (64, 32, 8, 2), ("fwd", 256): (32, 32, 8, 2),
    ("dq", 64): (64, 32, 8, 2), ("dq", 128): (64, 32, 8, 2), ("dq", 256): (32, 32, 8, 2),
    ("dkdv", 64): (32, 64, 8, 2), ("dkdv", 128): (16, 64, 4, 2), ("dkdv", 256): (16, 16, 4, 2),
}


@functools.lru_cache(maxsize=None)
def _default_plan(kind: str, width: int, dtype: torch.dtype, rows: str) -> Plan:
    """Under the interpreter (CI): tiles of 16, so that small sequences still take the
    multi-block paths (window edges, partial blocks, the sink's blocks) at low cost.

    On the GPU: plans for sm_90 that fit its shared memory (tests/local_arch_build.py
    builds and prints them), timed for 16-bit inputs at head_dim 64 and 128 (``_PLANS_16BIT``);
    float32 inputs spill a few hundred bytes per thread in every plan tried (not a
    performance target: correct, slower). ``benchmarks/bench_local.py --tune`` times others
    (``OVERRIDES``)."""
    if INTERPRET:
        return Plan(16, 16, 4, 1)
    key = kind, max(64, width)
    if dtype == torch.float32:
        return Plan(*_PLANS_32BIT[key])
    return Plan(*_CLASS_PLANS_16BIT.get(rows, {}).get(key, _PLANS_16BIT[key]))


def precision(dtype: torch.dtype) -> int:
    """How the kernels multiply (``local.tiles.product``): exact fp32 under the interpreter
    (its bf16 dot is wrong), 3xTF32 for float32 inputs on the GPU, else the inputs' dtype."""
    if INTERPRET:
        return IEEE
    return TF32X3 if dtype == torch.float32 else NATIVE


def _flags(head_dim: int, pattern: Pattern, dropout_p: float, dtype: torch.dtype,
           counts: Optional[torch.Tensor]) -> dict:
    """The constexprs the forward, dkdv and dq kernels share: a build per head dim, dtype,
    kind of pattern (a sliding window, or blocks), with or without sink and dropout."""
    return dict(D=head_dim, BLOCK_D=tile_side(head_dim), PERIODIC=pattern[0] != 1, HAS_SINK=pattern[3] > 0,
                HAS_DROPOUT=dropout_p > 0, PRECISION=precision(dtype), COUNT_TILES=counts is not None)


def fold_scale(scale: float, head_dim: int) -> bool:
    """Whether the forward applies the scale inside its exponent's FMA, exp2(s * scale - max)
    with the row maximum of the unscaled scores s, rather than scaling the logits first:
    one FP32 instruction fewer per logit (sm_90 build, head_dim 64, long-row plan: 2536 ->
    2376 SASS instructions). Only for a positive scale (a negative one reverses the scores'
    order and turns a masked -inf into +inf; 0 gives NaN) and head_dim up to 64, where the
    softmax's instructions bound the forward. H100, bf16, 3 alternating rounds, 2026-11-26:
    causal (B 2, H 16) at S 16384 2.774 -> 2.607 ms, S 4096 0.238 -> 0.228; 16-frame windows
    at S 65536 2.122 -> 2.024. At head_dim 128 it measured neutral (global attention at S
    16384 4.558 -> 4.580 ms, 4 rounds), and is left off."""
    return scale > 0 and tile_side(head_dim) <= 64


def _options(tiles: Plan) -> dict:
    return dict(compiler_options(tiles.num_warps), num_stages=tiles.num_stages)


def local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float,
                  dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
                  counts: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, S_q, D) in q's dtype and layout (``torch.empty_like``), and lse (B, H, S_q)
    fp32, from validated q (B, H, S_q, D), k and v (B, H_kv, S_k, D) (query i at key position
    i + S_k - S_q, ``local.tiles``). ``seed``: a one-element
    int64 tensor, with dropout_p > 0. ``counts``: tests only, an int32 (2,) tensor to which
    the tiles visited without and with a mask are added."""
    B, H, S, D = q.shape
    S_k = k.shape[2]
    arch = tensor_arch(q)
    tiles = plan("fwd", D, q.dtype, row_class(pattern, S, S_k, B * H, arch, dropout_p > 0), S, S_k, arch)
    out = torch.empty_like(q)
    lse = q.new_empty((B, H, S), dtype=torch.float32)
    grid = (cdiv(S, tiles.block_m) * B * H,)
    launcher(local_attention_fwd_kernel)[grid](
        q, k, v, out, lse, seed if dropout_p > 0 else unused_pointer(q, traced_launch()), counts,
        scale * LOG2E, dropout_p, S, S_k, H, H // k.shape[1], *pattern,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **_flags(D, pattern, dropout_p, q.dtype, counts),
        FOLD_SCALE=fold_scale(scale, D), **_options(tiles),
    )
    return out, lse


def local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, pattern: Pattern, scale: float, dropout_p: float = 0.0,
                   seed: Optional[torch.Tensor] = None, counts: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the layouts of q, k, v (``torch.empty_like``), from the forward's out
    and lse and the same seed; dout any strides. ``counts``: tests only, (4,) int32: the
    dkdv kernel's tiles without and with a mask, then the dq kernel's."""
    B, H, S, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = q.new_empty((B, H, S), dtype=torch.float32)
    arch = tensor_arch(q)
    rows_class = row_class(pattern, S, S_k, B * H, arch, dropout_p > 0)
    rows = plan("dq", D, q.dtype, rows_class, S, S_k, arch)
    flags = _flags(D, pattern, dropout_p, q.dtype, counts)
    seed_ptr = seed if dropout_p > 0 else unused_pointer(q, traced_launch())
    # dq first: it also stores each row's delta, which the dkdv kernel reads
    launcher(local_attention_bwd_dq_kernel)[(cdiv(S, rows.block_m) * B * H,)](
        q, k, v, out, dout, lse, delta, dq, seed_ptr, counts[2:] if counts is not None else None,
        scale * LOG2E, scale, dropout_p, S, S_k, H, H // H_kv, *pattern,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *dout.stride(), *dq.stride(),
        BLOCK_M=rows.block_m, BLOCK_N=rows.block_n, **flags, **_options(rows),
    )
    cols = plan("dkdv", D, q.dtype, rows_class, S, S_k, arch)
    launcher(local_attention_bwd_dkdv_kernel)[(cdiv(S_k, cols.block_n) * B * H_kv,)](
        q, k, v, dout, lse, delta, dk, dv, seed_ptr, counts,
        scale * LOG2E, scale, dropout_p, S, S_k, H_kv, H // H_kv, *pattern,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        BLOCK_M=cols.block_m, BLOCK_N=cols.block_n, **flags, **_options(cols),
    )
    return dq, dk, dv


def dropout_factors(seed: torch.Tensor, batch: int, heads: int, queries: int, dropout_p: float,
                    keys: Optional[int] = None) -> torch.Tensor:
    """Tests only: (B, H, S_q, S_k) fp32 (S_k = S_q unless ``keys``), keep / (1 - p) where the
    kernels keep a probability and 0 where they drop it, for the one-element int64 ``seed``
    the op drew."""
    keys = queries if keys is None else keys
    out = torch.empty((batch, heads, queries, keys), dtype=torch.float32, device=seed.device)
    block = 32
    launcher(local_dropout_factor_kernel)[(batch * heads, cdiv(queries, block), cdiv(keys, block))](
        seed, out, dropout_p, queries, keys, BLOCK=block, **compiler_options())
    return out
