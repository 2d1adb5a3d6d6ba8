"""Host side of the kernels: allocate outputs, pick tiles, split the windows, launch.

These functions take validated tensors (see ``timm_flashwin.op``) and are written with
torch operations and ``wrap_triton`` launches only, so that ``torch.library.triton_op``
can trace them under torch.compile.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import config, fast_launch
from .plan import backward_plan, forward_plan
from .backward import window_attention_bwd_fused_kernel
from .backward_dkdv import window_attention_bwd_delta_kernel, window_attention_bwd_dkdv_kernel
from .backward_dq_dbias import (window_attention_bwd_dbias_kernel, window_attention_bwd_dq_finish_kernel,
                                window_attention_bwd_dq_kernel)
from .bias_copy import float16_bias_copy_kernel
from .forward import window_attention_fwd_kernel
from ..window_grid import WindowGrid

if config.INTERPRET or not hasattr(torch.library, "wrap_triton"):
    # interpreted kernels are plain Python, launched as they are (on CPU tensors); torch
    # before 2.6 has no wrap_triton and launches kernels directly too
    def wrap_triton(kernel):
        return kernel

    def _traced_launch() -> bool:
        return False
else:
    from torch.library import wrap_triton
    # whether wrap_triton records launches for tracing (else they run as they are); where
    # a torch cannot say, launches count as traced
    _traced_launch = getattr(getattr(torch._library, "triton", None), "is_wrap_triton_enabled", lambda: True)


def launcher(kernel):
    """``launcher(kernel)[grid](*args, **kwargs)``: the kernel's launch as ``wrap_triton``
    records it while torch.compile traces (and as the interpreter runs it), else a direct
    launch that skips Triton's per-launch binding where it can (``fast_launch``)."""
    return _Launcher(kernel)


class _Launcher:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        if config.INTERPRET or _traced_launch():
            return wrap_triton(self.kernel)[grid]
        return lambda *args, **kwargs: _launch_on_device(self.kernel, grid, args, kwargs)


def _launch_on_device(kernel, grid, args, kwargs) -> None:
    """A direct launch on the device of the first argument (every launcher's first argument
    is a tensor): Triton launches on the current CUDA device, which a model moved to
    another GPU (``.to("cuda:1")``) does not change. Traced launches get inductor's own
    device guard."""
    device = args[0].device.index
    if device == torch.cuda.current_device():
        fast_launch.launch(kernel, grid, args, kwargs, device)
    else:
        with torch.cuda.device(device):
            fast_launch.launch(kernel, grid, args, kwargs, device)


def compiler_options(num_warps: int = 4) -> dict:
    """Warps and, where the kernel is launched directly, ``enable_fp_fusion=True``: the
    kernels were written and measured with the compiler contracting a multiply and an add
    into one FMA (one instruction per logit fewer in several places; the precision notes
    assume its single rounding), which Triton did by default up to 3.9 and says it will
    not from 3.10 (it warns where a launch leaves the option unset). Traced launches
    (torch.compile) go without it: inductor takes a user kernel's warps and stages only,
    and compiles it with the Triton default."""
    options = dict(num_warps=num_warps)
    if not _traced_launch():
        options["enable_fp_fusion"] = True
    return options


def launch_options(tiles: config.LaunchConfig, dropout: bool) -> dict:
    """Warps, stages and, where the kernel is launched directly, the register cap and FMA
    contraction (``compiler_options``).

    A launch traced for torch.compile ends in inductor's own launcher, which takes a user
    kernel's warps and stages but not ``maxnreg`` (torch 2.11 to 2.14: config_to_dict
    drops it), so traced launches go without it: compiled models run those kernels at the
    compiler's register count. Nor with attention dropout: its random numbers keep more
    registers live, and under the cap 0.4 to 2.2 KB per thread would spill (sm_90 build,
    tests/sm90_build.py).
    """
    options = dict(compiler_options(tiles.num_warps), num_stages=tiles.num_stages)
    if tiles.maxnreg is not None and not dropout and not _traced_launch():
        options["maxnreg"] = tiles.maxnreg
    return options


def _fp32_dot(dtype: torch.dtype) -> bool:
    # float32 inputs get exact fp32 products (no tf32). Triton's interpreter (3.6 to 3.9) holds
    # bf16 as uint16 and its tl.dot multiplies those bit patterns as integers: products there
    # are taken in fp32.
    return dtype == torch.float32 or config.INTERPRET


def _bias_mask_args(bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], qkv: torch.Tensor,
                    table: bool = False):
    """Pointers and strides of the bias, (H, N, N) or with the mask folded in (nW, H, N, N)
    (``streamed_bias``), and of the mask (nW, N, N); a dummy where absent. The bias's
    strides are (window, head, row, column), 0 along a dimension of one (a bias without
    windows serves every window, a folded mask without a bias every head). ``table``: the
    bias is a table (T, H) read through an index (``tiles.load_table_bias_mask``): its head
    stride and its rows' stride in the head and row places."""
    if table:
        return bias, mask if mask is not None else qkv, (0, bias.stride(1), bias.stride(0), 0), (
            mask.stride() if mask is not None else (0, 0, 0))
    bias_ptr = bias if bias is not None else qkv
    mask_ptr = mask if mask is not None else qkv
    if bias is None:
        bias_strides = (0, 0, 0, 0)
    else:
        sizes = (1, *bias.shape)[-4:]
        strides = (0, *bias.stride())[-4:]
        bias_strides = tuple(0 if size == 1 else stride for size, stride in zip(sizes, strides))
    mask_strides = mask.stride() if mask is not None else (0, 0, 0)
    return bias_ptr, mask_ptr, bias_strides, mask_strides


def mask_structure(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whether the mask is timm's kind, M[w, i, j] = value * [region_i != region_j]: then
    the kernels that stream key blocks compute it from (nW, N) region ids instead of
    reading 4 * N * N bytes per window, head and query block. Measured on an H200
    (window 24, bf16, tune_op.py --dense mask, 2026-11-22): the multi-block backward
    1.11x faster (1741 -> 1572 us), the forward 1.03x slower (700 -> 719 us), this check
    included; with the forward's branch moved around its loops since, the forward reading
    region ids takes 635 us and reading the dense mask 843 us (same run, H200, V1).

    Returns regions (nW, N) int32 (region_i = the first j with M[w, i, j] == 0) and info
    (2 + nW,) fp32: [1.0 if the mask is exactly that structure else 0.0, value, then per
    window 1.0 if it is all one region (its mask all 0: ``tiles.window_in_one_region``)
    else 0.0], where value is the mask's minimum. "Exactly": the kernels' formula,
    where(same region, 0, value), reproduces every element (NaN never does). Checked on the device, with no host
    synchronization: the kernels read ``info`` and fall back to the dense mask where it
    says 0 (any other float mask, NaN, rows without a zero, ...). The forward computes it
    once for both passes (``mask_regions_used``).
    """
    regions = (mask == 0).to(torch.uint8).argmax(-1).to(torch.int32)
    value = mask.amin()
    same = regions[:, :, None] == regions[:, None, :]
    exact = (mask == torch.where(same, 0.0, value)).all()
    one_region = (regions == regions[:, :1]).all(-1)
    return regions, torch.cat((exact.to(torch.float32)[None], value.to(torch.float32)[None],
                               one_region.to(torch.float32)))


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


def folds_mask(dtype: torch.dtype, num_heads: int, num_periods: int, n: int) -> bool:
    """Whether the kernels that stream key blocks read the mask folded into their float16
    bias copy (``streamed_bias``) rather than read it themselves: with 16-bit inputs, where
    that (nW, H, N, N) copy is at most ``config.FOLDED_MASK_MAX_BYTES``. Shapes only, so
    that a traced call decides as an eager one does."""
    return dtype != torch.float32 and 2 * num_periods * num_heads * n * n <= config.FOLDED_MASK_MAX_BYTES


def reads_mask_apart(mask: Optional[torch.Tensor], dtype: torch.dtype, num_heads: int, n: int) -> bool:
    """Whether the kernels that stream key blocks read a mask of their own: there is one and
    it is not folded into their bias copy (``folds_mask``)."""
    return mask is not None and not folds_mask(dtype, num_heads, mask.shape[0], n)


def streamed_bias(bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], dtype: torch.dtype, num_heads: int
                  ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], bool]:
    """(bias, mask, BIAS_LOG2E) as the kernels that stream key blocks read them.

    For float16 and bfloat16 inputs: a float16 copy of (bias + mask) times log2(e), (nW, H,
    N, N) (nW 1 without a mask, H 1 without a bias), and no mask, where that copy is small
    enough (``folds_mask``), else a float16 copy of the bias alone and the mask as it is;
    for float32 inputs the bias (H, N, N), contiguous, and the mask as it is (the kernels
    read it through its region ids where it has them, ``mask_structure``).

    Those kernels read a tile of the bias for every (window, query block, key block): on
    window 16 (512, 3, 256, 32) 400 MB of reads per forward from L2. Read as float16 (H100,
    bf16, kernels alone, tune_op.py --bias-dtype, 2026-11-23), the forward took 153 -> 111
    us on window 16 V1, 179 -> 139 cosine, 422 -> 302 and 492 -> 385 us on window 24 (no
    bias at all: 97, 122, 260, 333 us); the backward, whose heavy part is the bias
    gradient, not the bias reads, 1 to 4% less. Times log2(e), the kernels add it to their
    log2-domain logits as it is: one multiply per logit fewer.

    With the mask folded in, the kernels spend nothing on it per logit (timm's region mask
    took a compare and a predicated multiply-add per logit: 194 of a 64x128 step's 835
    instructions on window 16, ncu), for a copy of nW * H * N * N float16 values per bias
    (inference with a cached bias: once). H200, bf16, kernels alone (tune_op.py
    --only-default, 2026-11-24), forward / backward us, region ids -> folded: window 16 V1
    87.9 / 307.7 -> 82.2 / 290.0, cosine 120.7 / 374.7 -> 116.4 / 368.5; window 24 V1 272.6
    / 863.0 -> 263.5 / 832.1, cosine 356.0 / 1114.6 -> 341.7 / 1023.5 (the whole op, the
    copy included: H200, 2026-11-24, e358ac1).

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
    if dtype != torch.float32:
        fold = mask is not None and folds_mask(dtype, num_heads, mask.shape[0], mask.shape[-1])
        if bias is None and not fold:
            return None, mask, False
        folded = mask if fold else None
        owner = bias if bias is not None else mask
        make, log2e, read_mask = (lambda: _log2e_float16_copy(bias, folded)), True, None if fold else mask
        # a bias's copy with the mask folded in is keyed on the mask too (its storage and
        # version): not kept where the mask has no version (inference mode) or is traced
        other = folded if bias is not None else None
        keep = other is None or (type(other) is torch.Tensor and not other.is_inference())
    elif bias is None or bias.is_contiguous():
        return bias, mask, False
    else:
        owner, make, log2e, read_mask, other, keep = bias, bias.contiguous, False, mask, None, True
    if not keep or _traced_launch() or type(owner) is not torch.Tensor:
        return make(), read_mask, log2e
    key = () if other is None else (other.data_ptr(), other._version, other.shape, other.stride())
    # keyed on the copy's kind too: the same bias may serve float32 and 16-bit inputs in turn
    return kept_on(owner, "_flashwin_streamed_bias", make, log2e, *key), read_mask, log2e


def streams_key_blocks(n: int, head_dim: int, dtype: torch.dtype, cosine: bool) -> bool:
    """Whether a kernel of either pass streams key blocks, reading a tile of the bias
    (and mask) for every (window, query block, key block) rather than once per program."""
    return (n > config.forward_config(n, head_dim, dtype, cosine).block_n
            or not config.backward_config(n, head_dim, dtype, cosine).single_tile(n))


def _kept_key(tensor: torch.Tensor, key: tuple) -> tuple:
    return (tensor._version, tensor.data_ptr(), tensor.shape, tensor.stride(), *key)


def kept(tensor: torch.Tensor, name: str, *key):
    """What ``kept_on`` keeps on ``tensor`` under ``name`` for the tensor's present state
    (version, storage, shape, strides, ``key``), or None; computes nothing."""
    if tensor.is_inference():
        return None
    entry = tensor.__dict__.get(name)
    return entry[1] if entry is not None and entry[0] == _kept_key(tensor, key) else None


def kept_on(tensor: torch.Tensor, name: str, compute, *key):
    """``compute()``, kept on ``tensor`` (in its ``__dict__`` under ``name``) and computed
    again when the tensor's version counter (in-place changes), storage, shape or strides,
    or ``key``, differ from those it was computed for. Inference tensors (made under
    torch.inference_mode) have no version counter: for them it is computed every call."""
    if tensor.is_inference():
        return compute()
    value = kept(tensor, name, *key)
    if value is None:
        value = compute()
        tensor.__dict__[name] = (_kept_key(tensor, key), value)
    return value


_MASK_STRUCTURE = "_flashwin_mask_structure"


def _mask_structure_kept(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mask_structure(mask)``, kept on the mask tensor between eager calls: timm's shift
    masks are buffers, the same tensor in every call, and the check reads and writes the
    (nW, N, N) mask some ten times (a dozen small kernels in every forward).
    An in-place change of the mask (its version) or another tensor computes it again;
    traced launches (torch.compile) compute it in the graph.

    What is kept also holds the mask's kind as a Python bool, read from the device by the
    second call with the same mask (one synchronization per mask, not per call; a mask
    built anew in every forward, as timm's ``dynamic_mask`` does, is never read), so
    that eager calls launch only the kernel build of that kind (``_mask_kinds``). Not for
    inference tensors (nothing is kept) nor while a CUDA graph is captured."""
    if _traced_launch() or type(mask) is not torch.Tensor:
        return mask_structure(mask)
    structure = kept(mask, _MASK_STRUCTURE)
    if structure is None:  # the first call with this mask, or it changed: its kind stays on the device
        structure = kept_on(mask, _MASK_STRUCTURE, lambda: [*mask_structure(mask), None])
    elif structure[2] is None and not (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        structure[2] = bool(structure[1][0])
    return structure[0], structure[1]


def mask_regions_used(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, mask: Optional[torch.Tensor],
                      num_heads: int) -> bool:
    """Whether a kernel of either pass streams key blocks over a mask that it reads itself
    (float32 inputs; 16-bit inputs read it folded into the bias, ``streamed_bias``), and so
    uses its region ids (``mask_structure``), which the forward then computes for both passes."""
    return (config.MASK_REGIONS and reads_mask_apart(mask, dtype, num_heads, n)
            and streams_key_blocks(n, head_dim, dtype, cosine))


def mask_regions_shapes(num_periods: int, n: int, used: bool) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Shapes of the forward's region ids and mask info outputs: (nW, N) and (2 + nW,),
    or empty where no kernel uses them."""
    return ((num_periods, n), (2 + num_periods,)) if used else ((0,), (0,))


def _mask_kinds(mask_regions: bool, mask: Optional[torch.Tensor]) -> Tuple[bool, ...]:
    """The FROM_REGIONS of each launch of a kernel that streams key or query blocks. With
    region ids (``mask_regions_used``), each kernel is built once per kind of mask
    (``tiles.mask_kind_launch``): where the host knows the mask's kind (eager calls with a
    kept mask structure, ``_mask_structure_kept``), one launch of that kind; else two, one
    per kind, the programs of the launch whose kind the mask is not returning at once (the
    kind is then only on the device). The launch of the other kind took 6.7 to 6.9 us per
    dkdv call on window 16 (H200, Nsight Compute: 6144 programs that read two numbers and
    return)."""
    if not mask_regions:
        return (False,)
    known = None
    if not _traced_launch() and type(mask) is torch.Tensor:
        structure = kept(mask, _MASK_STRUCTURE)
        known = structure[2] if structure is not None else None
    return (True, False) if known is None else (known,)


def softmax_stats_shape(num_windows: int, num_heads: int, n: int, head_dim: int, dtype: torch.dtype,
                        cosine: bool, save: bool = True) -> Tuple[int, ...]:
    """Shape of what the forward saves for the backward: (2, B_, H, N) row max and
    1 / row sum where the backward streams key blocks, plus the rows' mean score and their
    inverse norms for cosine attention (4, B_, H, N); nothing where a whole window fits one
    backward tile (it renormalizes the rows itself), nor where no backward will run
    (``save`` False)."""
    if not save or config.backward_config(n, head_dim, dtype, cosine).single_tile(n):
        return (0,)
    return (4 if cosine else 2, num_windows, num_heads, n)


def attention_forward(
    qkv: torch.Tensor,
    num_heads: int,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor],
    scale: float,
    cosine: bool,
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    save_stats: bool = True,
    grid: Optional[WindowGrid] = None,
    table_index: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns out (B_, N, H*D) in qkv's dtype, the softmax statistics (fp32,
    ``softmax_stats_shape``; empty without ``save_stats``, where no backward follows)
    and the mask's region ids and info (``mask_structure``; empty where unused), which
    the backward takes back. ``logit_scale``: the cosine logit scale as the module holds
    it, (H,) (the kernels clamp and exponentiate it), None for V1. ``seed``: a
    one-element int64 tensor, with dropout_p > 0. ``grid``: qkv is in the feature-map layout
    (B, H*W, 3*H*D) of that ``WindowGrid``; out is then (B, H*W, H*D), and window
    b = image * nW + w as in the partitioned layout. ``table_index``: ``bias`` is a table (T, H)
    and this (N, N) int32 contiguous index says which of its rows each token pair reads,
    ``table_sigmoid`` the sigmoid scale (0: none), read in the kernel (``reads_table``)."""
    table = table_index is not None
    traced = _traced_launch()
    plan = forward_plan(qkv, num_heads, bias is not None, mask, cosine, dropout_p > 0, save_stats, grid, table,
                        table_sigmoid, traced)
    # before the outputs are allocated: its (nW, N, N) temporaries then add less to the peak
    if plan.regions_used:
        regions, mask_info = _mask_structure_kept(mask)
    else:
        regions = qkv.new_empty((0,), dtype=torch.int32)
        mask_info = qkv.new_empty((0,), dtype=torch.float32)
    out = qkv.new_empty(plan.out_shape)
    stats = qkv.new_empty(plan.stats_shape, dtype=torch.float32)
    # the kernel reads its bias tile once per program where a window is one key block, else streams it
    read_bias, read_mask, _ = (streamed_bias(bias, mask, qkv.dtype, num_heads) if plan.streams
                               else (bias, mask, False))
    _check_flags(plan, read_bias, read_mask)
    bias_ptr, mask_ptr, bias_strides, mask_strides = _bias_mask_args(read_bias, read_mask, qkv, table)
    mask_regions = plan.mask_regions
    for from_regions in _mask_kinds(mask_regions, mask):
        launcher(window_attention_fwd_kernel)[plan.programs](
            qkv, out, stats, bias_ptr, table_index if table else qkv, mask_ptr, regions if mask_regions else qkv,
            mask_info if mask_regions else qkv,
            logit_scale if logit_scale is not None else qkv,
            seed if dropout_p > 0 else qkv,
            scale, dropout_p,
            *qkv_strides(qkv, num_heads), *out.stride(), *bias_strides, *mask_strides,
            plan.periods, plan.per_period, plan.per_chunk, *plan.grid_args, **plan.kwargs[from_regions],
        )
    return out, stats, regions, mask_info


def qkv_strides(qkv: torch.Tensor, num_heads: int) -> Tuple[int, int, int, int, int]:
    """The strides of qkv's (window, token, q/k/v, head, dim) axes, which the kernels take:
    of qkv (B_, N, 3*H*D), q, k and v each H heads of D channels (timm's qkv linear), or of
    a (B_, N, 3, H, D) view, any strides (a qkv whose channels are (H, 3, D), or whose
    tokens are its innermost axis, is such a view of its tensor: ``window_attention``)."""
    if qkv.dim() == 5:
        return tuple(qkv.stride())
    stride_b, stride_n, stride_c = qkv.stride()
    head_dim = qkv.shape[2] // (3 * num_heads)
    return stride_b, stride_n, num_heads * head_dim * stride_c, head_dim * stride_c, stride_c


def _windows_tokens_channels(qkv: torch.Tensor, grid: Optional[WindowGrid]) -> Tuple[int, int, int]:
    """(B_, N, 3*H*D) of qkv in the partitioned layout ((B_, N, 3*H*D) or (B_, N, 3, H, D)),
    or in the feature-map layout (B, H*W, 3*H*D) of ``grid``: B_ = B * nW."""
    if grid is None:
        return qkv.shape[0], qkv.shape[1], qkv.shape[2:].numel()
    return qkv.shape[0] * grid.num_windows, grid.tokens, qkv.shape[2]


def _grid_args(grid: Optional[WindowGrid]) -> Tuple[int, ...]:
    """The layout's run-time arguments (``tiles.window_rows``): the feature-map geometry,
    placeholders for the partitioned layout."""
    return grid.kernel_args() if grid is not None else (1, 1, 1, 1, 0, 0)


def _layout_flags(grid: Optional[WindowGrid]) -> dict:
    """The constexprs of the layout: MAPPED, and the window's width (``tiles.window_rows``)."""
    return dict(MAPPED=grid is not None, WINDOW_W=grid.window[1] if grid is not None else 1)


def reads_table(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, dropout: bool) -> bool:
    """Whether the kernels of both passes read a position bias from its table for this
    shape (``table_index``): where a whole window is one tile of the forward and of the
    backward (the kernels that stream key blocks read the dense bias, or a copy of it)."""
    return (n <= config.forward_config(n, head_dim, dtype, cosine, dropout).block_n
            and config.backward_config(n, head_dim, dtype, cosine).single_tile(n))


def maps_windows(n: int, head_dim: int, dtype: torch.dtype, cosine: bool, backward: bool) -> bool:
    """Whether the kernels read and write the feature-map layout (``grid``) for this
    shape: the forward always, the backward where a whole window fits its one-tile kernel
    (the kernels that stream blocks address windows by their partitioned rows)."""
    return not backward or config.backward_config(n, head_dim, dtype, cosine).single_tile(n)


def dq_by_atomic_adds(tiles: config.LaunchConfig) -> bool:
    """Whether the multi-block backward adds dQ up with atomic adds in its dkdv kernel (one
    recomputation of P fewer) rather than in a dq kernel of its own: where the launch
    configuration says it is faster (``LaunchConfig.dq_atomic``), and never under
    ``torch.use_deterministic_algorithms(True)``: the order of fp32 atomic adds varies
    from run to run, and so would the last bits of dQ and of the cosine scale gradient
    (the bias gradient's: ``dbias_slots``)."""
    return tiles.dq_atomic and not torch.are_deterministic_algorithms_enabled()


def dbias_slots(tiles: config.LaunchConfig) -> int:
    """Into how many (H, N, N) fp32 slots the multi-block dkdv kernel adds the bias gradient
    with atomic adds, 0 where a dbias kernel of its own computes it (``LaunchConfig.
    dbias_slots``; 0 under ``torch.use_deterministic_algorithms(True)``)."""
    return 0 if torch.are_deterministic_algorithms_enabled() else tiles.dbias_slots


def dbias_sum_by_atomic_adds() -> bool:
    """Whether the dbias kernel adds its programs' sums into one (H, N, N) buffer with
    atomic adds rather than writing (nW * chunks, H, N, N) partials that a sum reduces
    afterwards: always but under ``torch.use_deterministic_algorithms(True)`` (the adds'
    order varies from run to run, and so would the last bits of the bias gradient)."""
    return not torch.are_deterministic_algorithms_enabled()


def attention_backward(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    regions: torch.Tensor,
    mask_info: torch.Tensor,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor],
    num_heads: int,
    scale: float,
    cosine: bool,
    bias_grad: bool,
    scale_grad: bool,
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    grid: Optional[WindowGrid] = None,
    table_index: Optional[torch.Tensor] = None,
    table_sigmoid: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Takes the forward's out, stats, regions and mask_info; regenerates the forward's
    dropout from the same ``seed``. Returns dqkv (qkv's shape and layout), dbias (H, N, N)
    fp32 and d(logit_scale) (H,) fp32; the last two are empty when not asked for (and, for
    windows of one tile, views of one tensor).
    ``grid``: as the forward's, where ``maps_windows`` allows it; ``table_index`` and
    ``table_sigmoid``: as the forward's (the bias gradient is still the dense one)."""
    table = table_index is not None
    plan = backward_plan(qkv, num_heads, bias is not None, mask, cosine, bias_grad, scale_grad, dropout_p > 0, grid,
                         table, table_sigmoid, _traced_launch())
    n, launches = plan.n, plan.launches
    # region ids computed by the forward, for the kernels that stream key blocks
    mask_regions = plan.mask_regions
    if not mask_regions:
        regions, mask_info = qkv, qkv
    dqkv = torch.empty_like(qkv)  # qkv's layout where that is dense (a view's gradient is then a view)
    # the one-tile kernel reads its bias tile once per program; the others stream it
    if plan.single_tile:
        read_bias, read_mask = bias, mask
    else:
        read_bias, read_mask, _ = streamed_bias(bias, mask, qkv.dtype, num_heads)
    _check_flags(plan, read_bias, read_mask)
    bias_ptr, mask_ptr, bias_strides, mask_strides = _bias_mask_args(read_bias, read_mask, qkv, table)
    scale_grad = plan.scale_grad
    logit_scale_ptr = logit_scale if logit_scale is not None else qkv
    seed_ptr = seed if dropout_p > 0 else qkv
    strides = (*qkv_strides(qkv, num_heads), *dout.stride(), *qkv_strides(dqkv, num_heads), *bias_strides,
               *mask_strides)
    windows = (plan.periods, plan.per_period)

    if plan.single_tile:
        partials = qkv.new_empty(plan.partials_shape, dtype=torch.float32)
        bias_size = plan.bias_size
        programs, kwargs = launches[("fused", False)]
        launcher(window_attention_bwd_fused_kernel)[programs](
            qkv, dout, bias_ptr, table_index if table else qkv, mask_ptr, logit_scale_ptr, seed_ptr,
            dqkv, partials, partials[:, bias_size:] if scale_grad else partials, scale, dropout_p, *strides,
            partials.stride(0), *windows, plan.per_chunk["fused"], *plan.grid_args, **kwargs,
        )
        sums = partials.sum(0) if bias_grad or scale_grad else partials.new_empty((0,))
        empty = sums.new_empty((0,))
        return (dqkv, sums[:bias_size].view(num_heads, n, n) if bias_grad else empty,
                sums[bias_size:] if scale_grad else empty)

    if stats.dim() != 4:  # (0,): not (2 or 3, B_, H, N); a static check, no guard when traced
        raise RuntimeError("window_attention backward: the forward saved no softmax statistics (it ran where "
                           "nothing required a gradient), and windows of this size need them")
    dq_atomic, slots = plan.dq_atomic, plan.slots
    # dQ summed over key blocks by the dkdv kernel's atomic adds (zeroed by the delta kernel)
    dq_acc = qkv.new_empty(plan.dq_acc_shape, dtype=torch.float32)
    delta = qkv.new_empty(plan.delta_shape, dtype=torch.float32)
    # the bias gradient's sums that atomic adds go into, zeroed by the delta kernel: the dkdv
    # kernel's slots, or the dbias kernel's one (H, N, N) sum (``dbias_sum_by_atomic_adds``).
    # The backward then launches none of the four fill kernels it did (the other three were
    # autograd's zero gradients of the statistics outputs, no longer materialized:
    # op._setup_context): H200, f+b us (3 alternated rounds), window 16 V1 409.8 -> 403.3,
    # cosine 520.5 -> 511.4; window 12 357.6 -> 351.0, 462.5 -> 455.7; window 24 1147.3 ->
    # 1138.9, 1487.1 -> 1476.6.
    dbias_sums = qkv.new_empty(plan.dbias_sums_shape, dtype=torch.float32)
    # d(head scale): added up per head by the dkdv kernel with atomic dQ (zeroed by the delta
    # kernel), else partials per (window, head, query block) from the dq kernel
    dscale = qkv.new_empty(plan.dscale_shape, dtype=torch.float32)
    programs, kwargs = launches[("delta", False)]
    launcher(window_attention_bwd_delta_kernel)[programs](
        out, dout, delta, dq_acc, dbias_sums, dbias_sums.numel(), -(-dbias_sums.numel() // programs[0]), dscale,
        *out.stride(), *dout.stride(), **kwargs,
    )
    for from_regions in _mask_kinds(mask_regions, mask):
        programs, kwargs = launches[("dkdv", from_regions)]
        launcher(window_attention_bwd_dkdv_kernel)[programs](
            qkv, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dqkv,
            dq_acc, dscale, dbias_sums, scale, dropout_p, stats.stride(0), max(slots, 1), *strides,
            *windows, plan.per_chunk["dkdv"], **kwargs,
        )
    if dq_atomic:
        programs, kwargs = launches[("dq_finish", False)]
        launcher(window_attention_bwd_dq_finish_kernel)[programs](
            qkv, logit_scale_ptr, dq_acc, dqkv, scale, *qkv_strides(qkv, num_heads), *qkv_strides(dqkv, num_heads),
            **kwargs,
        )
        del dq_acc  # before the bias gradient's partials are allocated: a lower peak
    else:
        for from_regions in _mask_kinds(mask_regions, mask):
            programs, kwargs = launches[("dq", from_regions)]
            launcher(window_attention_bwd_dq_kernel)[programs](
                qkv, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dqkv,
                dscale, scale, dropout_p, plan.periods, stats.stride(0), *strides, **kwargs,
            )
    if slots:
        # one slot is the sum itself (a reduce kernel over it took 5 us on window 16, H200)
        dbias = dbias_sums[0] if slots == 1 else dbias_sums.sum(0)
    elif bias_grad:
        atomic_sum = plan.atomic_sum
        dbias = dbias_sums if atomic_sum else qkv.new_empty(plan.dbias_partials_shape, dtype=torch.float32)
        programs, kwargs = launches[("dbias", False)]
        launcher(window_attention_bwd_dbias_kernel)[programs](
            qkv, dout, stats, delta, bias_ptr, mask_ptr, regions, mask_info, logit_scale_ptr, seed_ptr, dbias,
            scale, dropout_p, stats.stride(0), *qkv_strides(qkv, num_heads), *dout.stride(), *bias_strides,
            *mask_strides, *windows, plan.per_chunk["dbias"], **kwargs,
        )
        dbias = dbias[0] if atomic_sum else dbias.sum(0)
    else:
        dbias = qkv.new_empty((0,), dtype=torch.float32)
    return dqkv, dbias, dscale.sum((0, 2)) if scale_grad and not dq_atomic else dscale


def _check_flags(plan, read_bias: Optional[torch.Tensor], read_mask: Optional[torch.Tensor]) -> None:
    """The plan's HAS_BIAS and HAS_MASK are what the launch reads: the plan decided them
    from the signature by ``streamed_bias``'s rules, the launch from the tensors."""
    if (read_bias is not None) != plan.flags.has_bias or (read_mask is not None) != plan.flags.has_mask:
        raise RuntimeError(f"window_attention: launch plan reads bias {plan.flags.has_bias}, mask "
                           f"{plan.flags.has_mask}; the launch has bias {read_bias is not None}, mask "
                           f"{read_mask is not None}")
