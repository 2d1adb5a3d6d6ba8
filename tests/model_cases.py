"""What the model tests share: small seeded timm models perturbed as ``verify`` perturbs
them, images, and inspectors of what ran (autograd nodes, compiled graphs' calls, the
blocks whose windows the op read from the feature map)."""

import timm
import torch
from torch import nn

from timm_flashwin.patching.adapters import WindowAttentionAdapter
from timm_flashwin.tools.verify import perturb_


def create(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """timm.create_model with a seeded initialization, then perturbed (verify.perturb_)."""
    torch.manual_seed(seed)
    return perturb_(timm.create_model(name, **kwargs), seed)


def tiny_swin(**kwargs) -> nn.Module:
    """A small Swin V1 with shifted windows (two blocks per stage), for quick tests."""
    args = dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)
    args.update(kwargs)
    return create("swin_tiny_patch4_window7_224", **args)


def images(batch=2, size=(56, 56), seed=0, device="cpu"):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed)).to(device)


def autograd_nodes(out: torch.Tensor) -> list:
    """Names of the nodes of ``out``'s autograd graph (``name()``: a C++ node's type is
    CppFunction, its name the C++ class's)."""
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def recording_backend(graphs, inner="aot_eager"):
    """A torch.compile backend that keeps each graph's call targets, then compiles."""
    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)
    return backend


def flashwin_ops(graphs):
    """Calls of the attention operators, window and local (Hiera's pooling blocks) (the bias
    gather's operators, in training graphs of V1 and SwinV2 models, are not counted)."""
    return sum("timm_flashwin.window_attention" in t or "timm_flashwin.local_attention" in t for g in graphs for t in g)


def run_step(model, x, train, seed=0):
    """(output, {parameter name: gradient}) of one step of ``model`` on ``x`` in train or eval
    mode, the output's gradient a seeded random tensor."""
    model.train(train)
    torch.manual_seed(seed)  # SwinV2-CR's meta_mlp dropout draws the same masks on every side
    out = model(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.device, out.dtype)
    (out * g).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def maps_read_in_place(monkeypatch) -> list:
    """The grids of the block calls whose windows the op read from the feature map (the
    others ran timm's roll, partition, module call, merge and roll back)."""
    grids = []
    real = WindowAttentionAdapter.block_attention

    def spy(self, block, x, grid):
        grids.append(grid)
        return real(self, block, x, grid)

    monkeypatch.setattr(WindowAttentionAdapter, "block_attention", spy)
    return grids
