"""How the attention kernels read the bias and the mask, prepared on the host.

The kernels add B[h] + M[w] (bias (H, N, N), shift mask (nW, N, N)) to their logits.
Kernels whose window is one tile read both as they are, once per program; kernels that
stream key blocks read a tile of them for every (window, query block, key block), and
for them the host prepares cheaper reads:

* with 16-bit inputs, a float16 copy of the bias times log2(e), with the mask folded in
  where that copy is small (``streamed_bias``; ``kernel_reads`` gives the same answer from
  the call's description alone, for the launch plans);
* a mask of timm's kind, value * [region_i != region_j], as (nW, N) region ids
  (``mask_structure``), checked on the device and kept on the mask tensor between eager
  calls (``kept_mask_structure``, ``mask_kinds_to_launch``).

``bias_mask_args`` turns what the kernels read into their pointer and stride arguments.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import fast_launch
from .bias_copy import float16_bias_copy_kernel
from .call import DENSE_BIAS, LOG2E_COPY, NO_BIAS, TABLE_BIAS, WindowCall
from ..launcher import compiler_options, launcher, traced_launch
from ..tensor_cache import kept, kept_on


# ------------------------------------------------------------------ decided from the call
def folds_mask(call: WindowCall) -> bool:
    """Whether the kernels that stream key blocks read the call's mask folded into their
    float16 bias copy (``streamed_bias``) rather than read it themselves: with 16-bit inputs,
    where that (nW, H, N, N) copy is at most ``config.FOLDED_MASK_MAX_BYTES`` (the call's
    setting). From the call alone, so that a traced call decides as an eager one does."""
    n = call.tokens
    return (call.periods > 0 and call.dtype != torch.float32
            and 2 * call.periods * call.heads * n * n <= call.settings.folded_mask_max_bytes)


def reads_mask_apart(call: WindowCall) -> bool:
    """Whether the kernels that stream key blocks read a mask of their own: there is one and
    it is not folded into their bias copy (``folds_mask``)."""
    return call.periods > 0 and not folds_mask(call)


def kernel_reads(call: WindowCall, streams: bool, reads_table: bool) -> Tuple[int, bool]:
    """(bias kind, whether it reads a mask) of a kernel of this call (``call.NO_BIAS`` ...;
    the kernels' BIAS and HAS_MASK): ``streams``, whether it streams key blocks (else it
    reads bias and mask as they are, a ``TABLE_BIAS`` from its table where ``reads_table``);
    the bias and the mask that ``streamed_bias`` hands it, by the same rules."""
    has_mask = call.periods > 0
    if call.bias == TABLE_BIAS and reads_table and not streams:
        return TABLE_BIAS, has_mask
    dense = DENSE_BIAS if call.bias != NO_BIAS else NO_BIAS
    if not streams or call.dtype == torch.float32:
        return dense, has_mask
    fold = folds_mask(call)
    if dense == NO_BIAS and not fold:
        return NO_BIAS, has_mask
    return LOG2E_COPY, has_mask and not fold


# ------------------------------------------------------------------ the bias copy
def streamed_bias(call: WindowCall, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]
                  ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(bias, mask) as the kernels that stream key blocks read them (``kernel_reads`` says
    which kind: the bias as it is, or ``LOG2E_COPY``).

    For float16 and bfloat16 inputs: a float16 copy of (bias + mask) times log2(e), (nW, H,
    N, N) (nW 1 without a mask, H 1 without a bias), and no mask, where that copy is small
    enough (``folds_mask``), else a float16 copy of the bias alone and the mask as it is;
    for float32 inputs the bias (H, N, N), contiguous, and the mask as it is (the kernels
    read it through its region ids where it has them, ``mask_structure``).

    Those kernels read a tile of the bias for every (window, query block, key block): on
    window 16 (512, 3, 256, 32) 400 MB of reads per forward from L2. Read as float16 (H100,
    bf16, kernels alone, 2026-11-23), the forward took 153 -> 111
    us on window 16 V1, 179 -> 139 cosine, 422 -> 302 and 492 -> 385 us on window 24 (no
    bias at all: 97, 122, 260, 333 us); the backward, whose heavy part is the bias
    gradient, not the bias reads, 1 to 4% less. Times log2(e), the kernels add it to their
    log2-domain logits as it is: one multiply per logit fewer.

    With the mask folded in, the kernels spend nothing on it per logit (timm's region mask took a
    compare and a predicated multiply-add per logit: 194 of a 64x128 step's 835 instructions
    on window 16, ncu), for a copy of nW * H * N * N float16 values per bias (inference with a
    cached bias: once). H200, bf16, kernels alone (2026-11-24), forward / backward us, region
    ids -> folded: window 16 V1 87.9 / 307.7 -> 82.2 / 290.0, cosine 120.7 / 374.7 -> 116.4 /
    368.5; window 24 V1 272.6 / 863.0 -> 263.5 / 832.1, cosine 356.0 / 1114.6 -> 341.7 /
    1023.5 (the whole op, the copy included: H200, 2026-11-24, e358ac1).

    Precision: float16 keeps 11 bits, |error| <= |(bias + mask) * log2(e)| * 2^-12, below
    the bfloat16 rounding of P that the P V product takes anyway, and finer than timm's
    own fused path (scaled_dot_product_attention), which casts bias + mask to the inputs'
    dtype; under a large mask (timm's -100) the error is as large, on logits whose
    probabilities are e^-100 of their row's largest.
    Contiguous: SwinV2-CR's bias is a transposed view (column stride H), whose tiles would
    be read as single elements.
    The copy is kept on the bias tensor (``kept_on``, keyed on the mask too; on the mask
    where there is no bias): the backward reuses the forward's.
    """
    recipe = _streamed_recipe(call, bias, mask)
    if recipe is None:  # read as they are
        return bias, mask
    owner, make, read_mask, key = recipe
    if key is None:
        return make(), read_mask
    return kept_on(owner, _STREAMED_BIAS, make, *key), read_mask


def kept_streamed_bias(call: WindowCall, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]
                       ) -> Optional[torch.Tensor]:
    """The copy ``streamed_bias`` keeps for these inputs, where it keeps one and has made
    it, else None; computes nothing. The op's forward hands it to its backward's host
    program (the backward reads it from where the forward kept it)."""
    recipe = _streamed_recipe(call, bias, mask)
    if recipe is None:
        return None
    owner, _, _, key = recipe
    return kept(owner, _STREAMED_BIAS, *key) if key is not None else None


_STREAMED_BIAS = "_flashwin_streamed_bias"


def _streamed_recipe(call: WindowCall, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
    """``streamed_bias``'s decision: None where bias and mask are read as they are, else
    (owner, make, read_mask, key): ``make()`` computes the bias read, kept on ``owner`` under
    ``key`` (None: not kept)."""
    if call.dtype != torch.float32:
        fold = folds_mask(call)
        if bias is None and not fold:
            return None
        folded = mask if fold else None
        owner = bias if bias is not None else mask
        make, read_mask, log2e = (lambda: _log2e_float16_copy(bias, folded)), None if fold else mask, True
        # a bias's copy with the mask folded in is keyed on the mask too (its storage and
        # version): not kept where the mask has no version (inference mode) or is traced
        other = folded if bias is not None else None
        keep = other is None or (type(other) is torch.Tensor and not other.is_inference())
    elif bias is None or bias.is_contiguous():
        return None
    else:
        owner, make, read_mask, log2e, other, keep = bias, bias.contiguous, mask, False, None, True
    if not keep or traced_launch() or type(owner) is not torch.Tensor:
        return owner, make, read_mask, None
    # keyed on the copy's kind too: the same bias may serve float32 and 16-bit inputs in turn
    key = (log2e,) if other is None else (log2e, other.data_ptr(), other._version, other.shape, other.stride())
    return owner, make, read_mask, key


def _log2e_float16_copy(bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(bias (H, N, N) + mask (nW, N, N)) times log2(e), any float dtype and strides, as a
    contiguous float16 (nW, H, N, N), nW or H 1 where the mask or the bias is missing
    (``float16_bias_copy_kernel`` says what becomes of values beyond float16's range)."""
    some = bias if bias is not None else mask
    n = some.shape[-1]
    heads = bias.shape[0] if bias is not None else 1
    windows = mask.shape[0] if mask is not None else 1
    out = some.new_empty((windows, heads, n, n), dtype=torch.float16)
    block = 1024
    launcher(float16_bias_copy_kernel)[(-(-out.numel() // block),)](
        bias if bias is not None else mask, mask if mask is not None else bias, out, out.numel(), n, heads,
        *(bias.stride() if bias is not None else (0, 0, 0)), *(mask.stride() if mask is not None else (0, 0, 0)),
        HAS_BIAS=bias is not None, HAS_MASK=mask is not None, BLOCK=block, **compiler_options(),
    )
    return out


# ------------------------------------------------------------------ the mask region ids
def mask_structure(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whether the mask is timm's kind, M[w, i, j] = value * [region_i != region_j]: then
    the kernels that stream key blocks compute it from (nW, N) region ids instead of
    reading 4 * N * N bytes per window, head and query block. Measured on an H200
    (window 24, bf16, 2026-11-22): the multi-block backward
    1.11x faster (1741 -> 1572 us), the forward 1.03x slower (700 -> 719 us), this check
    included; with the forward's branch moved around its loops since, the forward reading
    region ids takes 635 us and reading the dense mask 843 us (same run, H200, V1).

    Returns regions (nW, N) int32 (region_i = the first j with M[w, i, j] == 0) and info
    (2 + nW,) fp32: [1.0 if the mask is exactly that structure else 0.0, value, then per
    window 1.0 if it is all one region (its mask all 0: ``bias_mask_tiles.window_in_one_region``)
    else 0.0], where value is the mask's minimum. "Exactly": the kernels' formula,
    where(same region, 0, value), reproduces every element (NaN never does). Checked on
    the device, with no host synchronization: the kernels read ``info`` and fall back to
    the dense mask where it says 0 (any other float mask, NaN, rows without a zero, ...).
    The forward computes it once for both passes (``plan.CallPlan.regions_used``).
    """
    regions = (mask == 0).to(torch.uint8).argmax(-1).to(torch.int32)
    value = mask.amin()
    same = regions[:, :, None] == regions[:, None, :]
    exact = (mask == torch.where(same, 0.0, value)).all()
    one_region = (regions == regions[:, :1]).all(-1)
    return regions, torch.cat((exact.to(torch.float32)[None], value.to(torch.float32)[None],
                               one_region.to(torch.float32)))


_MASK_STRUCTURE = "_flashwin_mask_structure"


def kept_mask_structure(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mask_structure(mask)``, kept on the mask tensor between eager calls: timm's shift
    masks are buffers, the same tensor in every call, and the check reads and writes the
    (nW, N, N) mask some ten times (a dozen small kernels in every forward).
    An in-place change of the mask (its version) or another tensor computes it again;
    traced launches (torch.compile) compute it in the graph.

    What is kept also holds the mask's kind as a Python bool, read from the device by the
    second call with the same mask (one synchronization per mask, not per call; a mask
    built anew in every forward, as timm's ``dynamic_mask`` does, is never read), so
    that eager calls launch only the kernel build of that kind (``mask_kinds_to_launch``).
    Not for inference tensors (nothing is kept) nor while a CUDA graph is captured; nor
    read while a host program is recorded (``fast_launch.RECORD``): its replays launch the
    builds of both kinds, whatever the mask becomes, and a read is no launch."""
    if traced_launch() or type(mask) is not torch.Tensor:
        return mask_structure(mask)
    structure = kept(mask, _MASK_STRUCTURE)
    if structure is None:  # the first call with this mask, or it changed: its kind stays on the device
        structure = kept_on(mask, _MASK_STRUCTURE, lambda: [*mask_structure(mask), None])
    elif structure[2] is None and fast_launch.RECORD is None and not (
            mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        structure[2] = bool(structure[1][0])
    return structure[0], structure[1]


def mask_regions_shapes(num_periods: int, n: int, used: bool) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Shapes of the forward's region ids and mask info outputs: (nW, N) and (2 + nW,),
    or empty where no kernel uses them."""
    return ((num_periods, n), (2 + num_periods,)) if used else ((0,), (0,))


def mask_kinds_to_launch(mask_regions: bool, mask: Optional[torch.Tensor]) -> Tuple[bool, ...]:
    """The FROM_REGIONS of each launch of a kernel that streams key or query blocks. With
    region ids (``plan.CallPlan.regions_used``), each kernel is built once per kind of mask
    (``bias_mask_tiles.mask_kind_launch``): where the host knows the mask's kind (eager calls with a
    kept mask structure, ``kept_mask_structure``), one launch of that kind; else two, one
    per kind, the programs of the launch whose kind the mask is not returning at once (the
    kind is then only on the device). The launch of the other kind took 6.7 to 6.9 us per
    dkdv call on window 16 (H200, Nsight Compute: 6144 programs that read two numbers and
    return)."""
    if not mask_regions:
        return (False,)
    known = None
    # a host program's recording launches both: its replays serve the mask as it will be
    if not traced_launch() and type(mask) is torch.Tensor and fast_launch.RECORD is None:
        structure = kept(mask, _MASK_STRUCTURE)
        known = structure[2] if structure is not None else None
    return (True, False) if known is None else (known,)


# ------------------------------------------------------------------ kernel arguments
def bias_mask_args(bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], unused: torch.Tensor,
                   table: bool = False
                   ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, int, int, int], Tuple[int, int, int]]:
    """Pointers and strides of the bias, (H, N, N) or with the mask folded in (nW, H, N, N)
    (``streamed_bias``), and of the mask (nW, N, N); ``unused`` where absent
    (``launcher.unused_pointer``). The bias's strides are (window, head, row, column), 0
    along a dimension of one (a bias without windows serves every window, a folded mask
    without a bias every head). ``table``: the bias is a table (T, H) read through an index
    (``bias_mask_tiles.table_bias``): its head stride and its rows' stride in the
    head and row places."""
    if table:
        return bias, mask if mask is not None else unused, (0, bias.stride(1), bias.stride(0), 0), (
            mask.stride() if mask is not None else (0, 0, 0))
    bias_ptr = bias if bias is not None else unused
    mask_ptr = mask if mask is not None else unused
    if bias is None:
        bias_strides = (0, 0, 0, 0)
    else:
        sizes = (1, *bias.shape)[-4:]
        strides = (0, *bias.stride())[-4:]
        bias_strides = tuple(0 if size == 1 else stride for size, stride in zip(sizes, strides))
    mask_strides = mask.stride() if mask is not None else (0, 0, 0)
    return bias_ptr, mask_ptr, bias_strides, mask_strides
