"""Data-parallel training of a patched model, on CPUs: 2 processes, gloo.

One training step under DistributedDataParallel and under FSDP2 (``fully_shard``), each
process on half of a fixed global batch, gives the gradients and updated weights of one
single-process step on the whole batch. And examples/train_ddp.py runs as its docstring
says. The processes run the Triton kernels under the interpreter (TRITON_INTERPRET=1, as
in this process), or PyTorch's path on a machine with a GPU, where conftest does not set it.
"""
import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from test_patching import images, tiny_swin
from timm_flashwin import is_patched, patch_model, patch_report
from timm_flashwin.kernels import config

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import fully_shard

WORLD_SIZE = 2
GLOBAL_BATCH = 4
LR = 0.1
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_ddp.py"
#: kind -> (the wrapper's class name, the prefix it adds to module names)
WRAPPERS = {"ddp": ("DistributedDataParallel", "module."), "fsdp": ("FSDPSwinTransformer", "")}


def global_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch: images and labels of the tiny Swin's 10 classes."""
    labels = torch.randint(0, 10, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(1))
    return images(GLOBAL_BATCH), labels


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameters and gradients) gathered whole; others copied."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def train_step(model: nn.Module, parameters_of: nn.Module, x: torch.Tensor, y: torch.Tensor
               ) -> Dict[str, Dict[str, torch.Tensor]]:
    """One SGD step on mean cross entropy: {"grads": ..., "weights": after the step}, by
    the parameter names of ``parameters_of`` (the model inside a DDP wrapper)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = {name: full(p.grad) for name, p in parameters_of.named_parameters()}
    optimizer.step()
    weights = {name: full(p) for name, p in parameters_of.named_parameters()}
    return dict(grads=grads, weights=weights)


def wrap(model: nn.Module, kind: str) -> nn.Module:
    """DDP around the model, patched through the wrapper; or FSDP2 on a patched model:
    every transformer block sharded on its own, then the root."""
    if kind == "ddp":
        return patch_model(nn.parallel.DistributedDataParallel(model))
    patch_model(model)
    for layer in model.layers:
        for block in layer.blocks:
            fully_shard(block)
    return fully_shard(model)


def worker(rank: int, init_file: str, out_dir: str, interpret: bool) -> None:
    """One process: for each wrapper, a fresh model, half of the global batch, one step;
    results saved for the test."""
    assert config.INTERPRET == interpret, "TRITON_INTERPRET did not reach the worker"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        x, y = global_batch()
        for kind in WRAPPERS:
            model = tiny_swin(drop_path_rate=0.0)  # seeded: the same weights in every process
            wrapped = wrap(model, kind)
            attention = [(status.name, is_patched(wrapped.get_submodule(status.name)))
                         for status in patch_report(wrapped).modules]
            result = train_step(wrapped, model, x.chunk(WORLD_SIZE)[rank], y.chunk(WORLD_SIZE)[rank])
            torch.save(dict(result, attention=attention, wrapper=type(wrapped).__name__), f"{out_dir}/{kind}-{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Results saved: leave without Python's shutdown, which FSDP2 over gloo can abort (see
    # exit_before_interpreter_shutdown in examples/train_ddp.py); an exception above still
    # propagates and fails the test.
    os._exit(0)


def test_one_step_matches_single_process(tmp_path):
    """DDP and FSDP2 (one pair of processes for both, to start them once): every attention
    module inside the wrapper is patched, and each process's gradients and updated weights
    are those of one process on the whole batch."""
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path), config.INTERPRET), nprocs=WORLD_SIZE)
    x, y = global_batch()
    model = patch_model(tiny_swin(drop_path_rate=0.0))
    initial_head = model.head.fc.weight.detach().clone()
    expected = train_step(model, model, x, y)
    assert not torch.equal(expected["weights"]["head.fc.weight"], initial_head)  # the step did something
    for kind, (wrapper, prefix) in WRAPPERS.items():
        for rank in range(WORLD_SIZE):
            result = torch.load(tmp_path / f"{kind}-{rank}.pt")
            assert result["wrapper"] == wrapper
            assert result["attention"] == [(f"{prefix}layers.{i}.blocks.{j}.attn", True)
                                           for i in range(2) for j in range(2)]
            for what in ("grads", "weights"):
                assert result[what].keys() == expected[what].keys()
                for name, value in expected[what].items():
                    # atol relative to the tensor's largest value: elements that cancel to
                    # about 0 keep the rounding of their large terms
                    torch.testing.assert_close(result[what][name], value, rtol=1e-4,
                                               atol=1e-6 * max(1.0, value.abs().max().item()),
                                               msg=lambda m: f"{kind} rank {rank} {what} {name}: {m}")


# ------------------------------------------------------------------------------- example
def docstring_cpu_command() -> List[str]:
    """The example's CPU command, from its docstring: the arguments after ``torchrun``,
    optional ``[--fsdp]`` left out."""
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    match = re.search(r"TRITON_INTERPRET=1 torchrun (.*?)\s*\[--fsdp\]", doc.replace("\\\n", " "), re.S)
    assert match, "the example's docstring lost its CPU command"
    return shlex.split(match.group(1))


@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_example_runs_on_cpu(extra):
    """The docstring's CPU command, one step, with DDP and with FSDP2: exit code 0, and rank
    0 reports the patch and the step."""
    command = [sys.executable, "-m", "torch.distributed.run", *docstring_cpu_command(), "--steps", "1", *extra]
    assert "--device" in command and "--standalone" in command  # standalone: a free port, not 29500
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "patched 4 of 4 window-attention modules" in done.stdout
    assert re.search(r"step +0 +loss \d+\.\d+ +\d+\.\d images/s", done.stdout), done.stdout
