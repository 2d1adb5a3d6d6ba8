"""Launch plans of the local-attention kernels, decided once per call signature.

A call is described by a ``LocalCall`` (every static property: sizes, dtype, architecture,
pattern, dropout, the bias's kind and key grid); ``call_plan`` turns it into a
``LocalPlan``: each kernel's tiles, warps, stages and constexprs, its grid. Plans are
kept per ``LocalCall`` (a dict lookup on a tuple of plain values: eager calls are bound by
the host), not where a size is symbolic (torch.compile's tracing).

The tiles (``plan``) are decided per (kernel, head_dim, dtype, class of rows): B, S, the
pattern and the scale are run-time arguments of the kernels (a new sequence length or
window never recompiles); B, H, S and the pattern only pick the class (``row_class``: short
rows, long rows, or wide rows in a large grid), which picks between plans.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .. import budget
from ..arch import INTERPRET, Arch
from ..launcher import compiler_options, traced_launch
from .bias import DECOMPOSED, NO_BIAS
from ..sizes import cdiv, tile_side
from .tiles import IEEE, NATIVE, TF32X3

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
#: float32 at head_dim 96 and 128); with 4 warps it runs and matches float64. Nor the dq kernel
#: with 64 query rows at head_dim 65 to 128 beside a decomposed bias: on an H200 triton 3.6's
#: build read shared memory past its allocation in a 3xTF32 product (compute-sanitizer:
#: "Invalid __shared__ read of size 512 bytes", SAM's 14 x 14 windows at head_dim 80, an
#: illegal memory access or wrong gradients); with 32 rows and 4 warps it runs (208 -> 104 KiB
#: of shared memory, a 1312 -> 328 B stack frame: tests/local_arch_build.py --bias)
_PLANS_32BIT = {
    ("fwd", 64): (64, 32, 8, 2), ("fwd", 128): (64, 32, 8, 2), ("fwd", 256): (32, 32, 8, 2),
    ("dq", 64): (64, 32, 8, 2), ("dq", 128): (32, 32, 4, 2), ("dq", 256): (32, 32, 8, 2),
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


#: a decomposed bias whose key grid has this many columns takes key tiles of one grid row
#: (``local.bias``'s ROW_TILE: no gather, no one-hot products); the SAM / ViTDet global
#: blocks at 1024 px (64 x 64) and 2048 px (128 x 128)
ROW_TILE_WIDTHS = (64, 128)
#: the largest key grid side the one-hot layout takes (its dq accumulators are (BLOCK_M,
#: padded side) tiles of registers); the row layout takes any number of grid rows
MAX_ONE_HOT_SIDE = 128


class LocalCall(NamedTuple):
    """Every static property of one local-attention call: what its plans depend on, and the
    key they are kept by. ``pattern``: (period, before, after, sink) (``Pattern``); ``bias``:
    ``local.bias``'s kind, with the key grid (key_h, key_w) of a decomposed bias ((0, 0)
    without one); ``positive_scale``: whether the forward may fold the scale into its
    exponent (``fold_scale``)."""

    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    dtype: torch.dtype
    arch: Arch
    pattern: Pattern
    dropout: bool
    positive_scale: bool
    bias: int = NO_BIAS
    key_h: int = 0
    key_w: int = 0


class KernelPlan(NamedTuple):
    """One kernel's launch: its grid and keyword arguments (constexprs and options)."""

    tiles: Plan
    grid: Tuple[int]
    kwargs: dict


class LocalPlan(NamedTuple):
    """The forward's, the dq kernel's and the dkdv kernel's launches of one ``LocalCall``."""

    fwd: KernelPlan
    dq: KernelPlan
    dkdv: KernelPlan


#: LocalCall -> LocalPlan
_CALL_PLANS: Dict[LocalCall, LocalPlan] = {}


def call_plan(call: LocalCall, counts: bool = False) -> LocalPlan:
    """The launches of ``call`` (kept per call; not with ``counts``, the tests' tile counts,
    nor while a launch is traced for torch.compile (its options differ:
    ``launcher.compiler_options``), a size is symbolic (a SymInt of the operators'
    dynamic-shape dispatch cannot be hashed) or ``OVERRIDES`` holds a plan)."""
    if counts or OVERRIDES or traced_launch() or not all(type(size) is int for size in call[:6]):
        return _call_plan(call, counts)
    found = _CALL_PLANS.get(call)
    if found is None:
        found = _CALL_PLANS[call] = _call_plan(call, counts)
    return found


def clear() -> None:
    """Forget every call's plan (made again at the next call)."""
    _CALL_PLANS.clear()


def _call_plan(call: LocalCall, counts: bool) -> LocalPlan:
    rows = row_class(call.pattern, call.queries, call.keys, call.batch * call.heads, call.arch, call.dropout)
    shared = dict(D=call.head_dim, BLOCK_D=tile_side(call.head_dim), PERIODIC=call.pattern[0] != 1,
                  HAS_SINK=call.pattern[3] > 0, HAS_DROPOUT=call.dropout, PRECISION=precision(call.dtype),
                  COUNT_TILES=counts, BIAS=call.bias, KEY_H_PAD=tile_side(call.key_h), KEY_W_PAD=tile_side(call.key_w))
    kernels = {}
    for kind in ("fwd", "dq", "dkdv"):
        tiles = plan(kind, call.head_dim, call.dtype, rows, call.queries, call.keys, call.arch)
        if (kind, call.head_dim, call.dtype, rows) not in OVERRIDES:  # a plan given to compare is taken as it is
            tiles = _bias_tiles(kind, tiles, call)
        kwargs = dict(shared, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, ROW_TILE=row_tile(call, tiles),
                      num_stages=tiles.num_stages, **compiler_options(tiles.num_warps))
        if kind == "fwd":  # a bias is added to the scaled logits: nothing to fold into
            kwargs["FOLD_SCALE"] = call.bias == NO_BIAS and fold_scale(float(call.positive_scale), call.head_dim)
        if kind == "dkdv":
            grid = (cdiv(call.keys, tiles.block_n) * call.batch * call.kv_heads,)
        else:
            grid = (cdiv(call.queries, tiles.block_m) * call.batch * call.heads,)
        kernels[kind] = KernelPlan(tiles, grid, kwargs)
    return LocalPlan(**kernels)


def row_tile(call: LocalCall, tiles: Plan) -> bool:
    """Whether a kernel with these tiles takes a decomposed bias in its row layout: each key
    tile one row of the key grid (``local.bias``)."""
    return call.bias == DECOMPOSED and tiles.block_n == call.key_w


def _bias_tiles(kind: str, tiles: Plan, call: LocalCall) -> Plan:
    """``tiles`` as a decomposed bias takes them: key tiles of one grid row where the grid's
    width is one of ``ROW_TILE_WIDTHS``, fitted again to the architecture (where that halves
    the key tiles, the one-hot layout serves); for the one-hot layout's dq kernel, whose
    accumulators grow with the padded grid sides, query tiles of 32 rows beyond sides of 64;
    the one-hot layout's dkdv kernel, and rows of 128 keys (2048 px; their (BLOCK_M, 128)
    rel_w tiles spill 0.8 to 1.5 KB of stack per thread at 4 warps, sm_90 builds), at 8 warps.
    The plans' own warps elsewhere: at 8 warps SAM ViT-B's global block (64 x 64 keys, row
    layout) took 9.9 ms f+b with the forward's, 9.4 with the dq kernel's and 8.2 with the
    dkdv kernel's, against 8.1, 8.3 and 6.3 at 4 (H200, bf16, ``bench_rel_pos.py --tune
    global64``, 13338db); 14 x 14 windows read 4.0 ms with the dkdv kernel at 8 warps, 4.5 at
    4, when it gathered each logit's terms (13338db; its one-hot products since 2b5b21f are
    not tuned again: ``--tune window14``). Not float32 inputs at 8 warps (triton 3.6 builds
    their dkdv kernel of 16 query rows at 8 warps into an illegal memory access:
    ``_PLANS_32BIT``)."""
    if call.bias != DECOMPOSED or INTERPRET:
        return tiles
    if call.key_w in ROW_TILE_WIDTHS and tiles.block_n != call.key_w:
        tiles = Plan(tiles.block_m, call.key_w, tiles.num_warps, tiles.num_stages)
        tiles = budget.local_fit(kind, tiles, tile_side(call.head_dim), call.dtype.itemsize, call.arch) or tiles
    one_hot = tiles.block_n != call.key_w
    if kind == "dq" and one_hot and max(call.key_h, call.key_w) > 64 and tiles.block_m > 32:
        tiles = Plan(32, tiles.block_n, tiles.num_warps, tiles.num_stages)
    if ((kind == "dkdv" and one_hot) or tiles.block_n > 64) and call.dtype != torch.float32:
        tiles = Plan(tiles.block_m, tiles.block_n, max(tiles.num_warps, 8), tiles.num_stages)
    return tiles


def bias_fits(key_h: int, key_w: int) -> bool:
    """Whether the kernels take a decomposed bias over a (key_h, key_w) key grid: any number
    of rows of ``ROW_TILE_WIDTHS`` columns, else sides up to ``MAX_ONE_HOT_SIDE``."""
    return key_w in ROW_TILE_WIDTHS or max(key_h, key_w) <= MAX_ONE_HOT_SIDE
