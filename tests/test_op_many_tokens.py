"""The op on more than 1024 tokens (BEiT-large at 512 px: 32x32 patches and the class token,
N = 1025; MAX_TOKENS): the kernels that stream key blocks against the float64
reference, with a last key block of one token (1025) and of whole blocks (2048).

Under the interpreter a kernel's cost is per operation, not per element: these cases take
blocks of 256 or 512 (``config.OVERRIDES``), the GPU's 64-token blocks being the same code
on more steps (checked by hand at N = 1025 under the interpreter: bfloat16 V1 with 64x64
tiles, float32 cosine with a mask); the GPU runs its own tiles (``test_gpu_many_tokens``).
"""
import pytest
import torch

from conftest import KERNEL_DEVICE
from opcases import TOLERANCE, assert_matches_reference, forward_backward, make_case, reference_forward_backward
from timm_flashwin import window_attention
from timm_flashwin.kernels.window import config
from timm_flashwin.ops.window_checks import MAX_TOKENS


def _large_blocks(monkeypatch, n: int, head_dim: int, dtype: torch.dtype, cosine: bool, block: int) -> None:
    """Blocks of ``block`` tokens in every pass of (n, head_dim, dtype, cosine), on the CPU."""
    if KERNEL_DEVICE != "cpu":
        return
    for kind, default in (("fwd", config.forward_config), ("bwd", config.backward_config),
                          ("dbias", config.dbias_config)):
        tiles = config.with_changes(default(n, head_dim, dtype, cosine), block_m=block, block_n=block,
                                    flat_loop=False, maxnreg=None)
        monkeypatch.setitem(config.OVERRIDES, (kind, n, head_dim, dtype, cosine), tiles)


@pytest.mark.parametrize("n, cosine, bias, masked, dtype, block", [
    (1025, False, True, False, torch.float32, 256),  # BEiT-large at 512 px: the last block holds one token
    (1025, True, False, False, torch.bfloat16, 256),
    (MAX_TOKENS, False, False, True, torch.float32, 512),
], ids=["1025-v1-bias", "1025-cosine-bf16", "max-v1-mask"])
def test_many_tokens_match_reference(n, cosine, bias, masked, dtype, block, monkeypatch):
    """One window, one head of 16 channels, a bias or a mask of three regions. (The bias's
    gradient sums, (H, N, N), zeroed 128 elements a step, take the interpreter 15 s at
    N = 1025: one case has a bias.)"""
    _large_blocks(monkeypatch, n, 16, dtype, cosine, block)
    case = make_case(1, 1, 1, n, 16, cosine=cosine, masked=masked, dtype=dtype, device=KERNEL_DEVICE, seed=n,
                     with_bias=bias)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[dtype])


def test_more_than_max_tokens_is_refused():
    qkv = torch.zeros(1, MAX_TOKENS + 1, 3 * 16)
    with pytest.raises(ValueError, match=rf"a token count N in \[1, {MAX_TOKENS}\]"):
        window_attention(qkv, 1, scale=1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [577, 1025, 2048])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_many_tokens(n, cosine):
    """The GPU's own tiles on global windows of BEiT's sizes and the limit, bfloat16, a bias
    (16 heads of 64 channels, BEiT-large's)."""
    case = make_case(4, 1, 16, n, 64, cosine=cosine, masked=False, dtype=torch.bfloat16, device="cuda", seed=n)
    assert_matches_reference(forward_backward(window_attention, case), reference_forward_backward(case),
                             TOLERANCE[torch.bfloat16])
