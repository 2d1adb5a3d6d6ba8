"""What the host-program tests share: the replay cases of the window op, the inputs they
are built from, and the count of signatures whose program is ready."""
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from test_position_bias import relative_position_index
from timm_flashwin import TableBias, WindowGrid, window_attention
from timm_flashwin.ops import host_program


def shift_mask(windows: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.where(torch.rand(windows, n, n, generator=generator) < 0.3, -100.0, 0.0)


#: (name, window, heads, head_dim, dtype, bias kind, mask, grid, dropout)
CASES = [
    ("v1_table_mask", 7, 3, 32, torch.bfloat16, "table", True, False, 0.0),
    ("v1_dense_bias", 7, 4, 16, torch.float16, "dense", True, False, 0.0),
    ("cosine_sigmoid_table", 8, 4, 32, torch.float16, "sigmoid", False, False, 0.0),
    ("v1_feature_map", 7, 3, 32, torch.bfloat16, "table", True, True, 0.0),
    ("v1_dropout", 7, 3, 32, torch.bfloat16, "table", False, False, 0.1),
    ("v1_window12", 12, 4, 32, torch.bfloat16, "table", True, False, 0.0),
    ("cosine_sigmoid_window12", 12, 4, 32, torch.bfloat16, "sigmoid", True, False, 0.0),
    # float32: the kernels read the mask's region ids, kept on the mask, the programs' inputs
    ("v1_window12_float32", 12, 4, 32, torch.float32, "table", True, False, 0.0),
    # a dense bias made anew each call (SwinV2-CR's meta-MLP bias), no mask: windows of
    # several key blocks that record to the end (their float16 bias copy made in the call)
    ("dense_window12_no_mask", 12, 4, 32, torch.bfloat16, "dense", False, False, 0.0),
]


def case_call(case, qkv_grad: bool = True):
    """A function that runs ``case``'s op call, forward and backward: (out, *gradients)."""
    name, window, heads, head_dim, dtype, bias_kind, with_mask, with_grid, dropout = case
    n, images = window * window, 2 if HAS_CUDA else 1  # the CPU: half the interpreter time
    grid = WindowGrid(2 * window, 2 * window, (window, window), (window // 2,) * 2) if with_grid else None
    windows = images * (grid.num_windows if grid else 4)
    generator = torch.Generator().manual_seed(0)
    if grid:
        qkv = torch.randn(images, grid.height * grid.width, 3 * heads * head_dim, generator=generator)
    else:
        qkv = torch.randn(windows, n, 3 * heads * head_dim, generator=generator)
    qkv = qkv.to(KERNEL_DEVICE, dtype).requires_grad_(qkv_grad)
    table = torch.randn((2 * window - 1) ** 2, heads, generator=generator).to(KERNEL_DEVICE).requires_grad_()
    index = relative_position_index(window, window).to(KERNEL_DEVICE)
    leaves = [t for t in (qkv, table) if t.requires_grad]
    kwargs = dict(scale=head_dim ** -0.5)
    if bias_kind == "sigmoid":
        logit_scale = torch.full((heads, 1, 1), 2.3, device=KERNEL_DEVICE, requires_grad=True)
        kwargs = dict(logit_scale=logit_scale)
        leaves.append(logit_scale)
    table_bias = TableBias(table, index, 16.0 if bias_kind == "sigmoid" else None, constant_index=True)
    mask = shift_mask(4 if not grid else grid.num_windows, n).to(KERNEL_DEVICE) if with_mask else None
    out_shape = (*qkv.shape[:2], heads * head_dim)
    grad_out = torch.randn(out_shape, generator=generator).to(KERNEL_DEVICE, dtype)

    def run():
        torch.manual_seed(3)  # the dropout seed
        bias = table_bias if bias_kind != "dense" else table[index.view(-1)].view(n, n, heads).permute(2, 0, 1)
        out = window_attention(qkv, heads, bias=bias, mask=mask, dropout_p=dropout, grid=grid, **kwargs)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    return run


def ready_programs() -> int:
    """How many signatures have a program ready to replay."""
    return sum(s.index is not None for s in host_program._SIGNATURES.values())
