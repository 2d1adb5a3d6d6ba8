"""kernels.fast_launch: a kernel's second launch with the same specialization calls the
compiled kernel Triton's first launch returned, with the constexprs in parameter order;
anything Triton specializes on makes a new key. On CPU with stand-in kernels (the
interpreter launches kernels as Python, not through fast_launch), on the GPU with the
real ones against launches through Triton."""
import pytest
import torch

from conftest import KERNEL_DEVICE
from timm_flashwin import window_attention
from timm_flashwin.kernels import fast_launch


class _Compiled:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("direct", grid, args))


class _Kernel:
    """Stands in for a JITFunction with parameters (x, n, scale, BLOCK, FLAG)."""

    arg_names = ["x", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.launches, self.pre_run_hooks = [], []

    def run(self, *args, grid, warmup, **kwargs):
        self.launches.append(("triton", grid, args, kwargs))
        return _Compiled(self.launches)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(("jit", grid, args, kwargs))


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fast_launch, "_settings_key", lambda: ())
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    fast_launch.clear()
    yield
    fast_launch.clear()


def test_second_launch_calls_the_compiled_kernel(fresh):
    kernel, x = _Kernel(), torch.zeros(64, dtype=torch.float16)
    for scale in (0.5, 0.25):  # floats are not specialized: same key
        fast_launch.launch(kernel, (4,), (x, 48, scale), dict(BLOCK=64, FLAG=True, num_warps=4), 0)
    assert [launch[0] for launch in kernel.launches] == ["triton", "direct"]
    assert kernel.launches[1] == ("direct", (4, 1, 1), (x, 48, 0.25, 64, True))  # constexprs in parameter order


@pytest.mark.parametrize("change", ["dtype", "alignment", "integer", "constexpr", "option", "device"])
def test_what_triton_specializes_on_makes_a_new_key(fresh, change):
    kernel, x = _Kernel(), torch.zeros(64, dtype=torch.float16)
    args, kwargs, device = (x, 48, 0.5), dict(BLOCK=64, FLAG=True, num_warps=4), 0
    fast_launch.launch(kernel, (4,), args, kwargs, device)
    if change == "dtype":
        args = (x.to(torch.bfloat16), 48, 0.5)
    elif change == "alignment":
        args = (x[1:], 48, 0.5)  # 2 bytes past a 16-byte boundary
    elif change == "integer":
        args = (x, 49, 0.5)
    elif change == "constexpr":
        kwargs = dict(kwargs, FLAG=False)
    elif change == "option":
        kwargs = dict(kwargs, num_warps=8)
    else:
        device = 1
    fast_launch.launch(kernel, (4,), args, kwargs, device)
    assert [launch[0] for launch in kernel.launches] == ["triton", "triton"]


def test_pre_run_hooks_defaults_and_other_compiled_kernels_go_through_triton(fresh, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(64)
    for _ in range(2):  # FLAG left to its default: not kept
        fast_launch.launch(kernel, (1,), (x, 1, 1.0), dict(BLOCK=16), 0)
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    fast_launch.launch(kernel, (1,), (x, 1, 1.0), dict(BLOCK=16, FLAG=True), 0)
    assert [launch[0] for launch in kernel.launches] == ["triton", "triton", "jit"]
    kernel = _Kernel()
    monkeypatch.setattr(kernel, "run", lambda *a, **k: kernel.launches.append(("triton",)) or object())
    for _ in range(2):  # a compiled kernel that cannot be launched by grid: not kept
        fast_launch.launch(kernel, (1,), (x, 1, 1.0), dict(BLOCK=16, FLAG=True), 0)
    assert kernel.launches == [("triton",), ("triton",)]


@pytest.mark.cuda
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
def test_gpu_direct_launches_match_launches_through_triton(cosine, monkeypatch):
    """Forward and every gradient, one-tile and multi-block windows, aligned and misaligned
    qkv, launched alternately (each case's second launches direct): bitwise what launches
    through Triton give."""
    g = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    fast_launch.clear()
    # no atomic adds (their order varies from run to run): the dq and dbias kernels
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    for enabled, passes in ((True, 2), (False, 1)):  # direct launches: the second pass
        monkeypatch.setattr(fast_launch, "ENABLED", enabled)
        results[enabled] = []
        for n, offset in ((49, 0), (144, 0), (49, 1), (144, 3)) * passes:
            heads, dim = 3, 32
            g.manual_seed(n + offset)
            storage = torch.randn(4 * n * 3 * heads * dim + offset, device="cuda", generator=g, dtype=torch.bfloat16)
            qkv = storage[offset:].view(4, n, 3 * heads * dim).requires_grad_()
            bias = torch.randn(heads, n, n, device="cuda", generator=g, requires_grad=True)
            masked = torch.rand(2, n, n, device="cuda", generator=g) < 0.3
            mask = torch.zeros(2, n, n, device="cuda").masked_fill_(masked, -100.0)
            logit_scale = torch.randn(heads, device="cuda", generator=g, requires_grad=True) if cosine else None
            out = window_attention(qkv, heads, bias=bias, mask=mask, scale=None if cosine else dim ** -0.5,
                                   logit_scale=logit_scale)
            inputs = [t for t in (qkv, bias, logit_scale) if t is not None]
            grads = torch.autograd.grad(out.float().square().sum(), inputs)
            results[enabled].append(((n, offset), (out, *grads)))
    assert KERNEL_DEVICE == "cuda" and len(fast_launch._COMPILED) > 0
    for (case, direct), (_, through_triton) in zip(results[True][4:], results[False]):
        for a, b in zip(direct, through_triton):
            assert torch.equal(a, b), case
