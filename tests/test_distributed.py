"""Data-parallel training of a patched model: 2 processes, on CPUs (gloo) and on 2 GPUs
(NCCL, one GPU per process).

One training step under DistributedDataParallel and under FSDP2 (``fully_shard``), each
process on half of a fixed global batch, gives the gradients and updated weights of one
single-process step on the whole batch. And examples/train_ddp.py runs as its docstring
says. On CPUs the processes run the Triton kernels under the interpreter
(TRITON_INTERPRET=1, as in this process), or PyTorch's path on a machine with a GPU, where
conftest does not set it; on GPUs they run the compiled kernels.
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
from torch.distributed.device_mesh import init_device_mesh

from model_cases import images, tiny_swin
from timm_flashwin import is_patched, patch_model, patch_report
from timm_flashwin.kernels.arch import INTERPRET

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


def on_cpu(result: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Dict[str, torch.Tensor]]:
    """train_step's result with every tensor copied to the CPU, to save and compare."""
    return {what: {name: t.cpu() for name, t in tensors.items()} for what, tensors in result.items()}


def wrap(model: nn.Module, kind: str, device_type: str) -> nn.Module:
    """DDP around the model, patched through the wrapper; or FSDP2 on a patched model:
    every transformer block sharded on its own, then the root, over a mesh of the
    processes' devices (named: on a CPU run, FSDP2 would otherwise take the GPUs of a
    machine that has some)."""
    if kind == "ddp":
        return patch_model(nn.parallel.DistributedDataParallel(model))
    patch_model(model)
    mesh = init_device_mesh(device_type, (WORLD_SIZE,))
    for layer in model.layers:
        for block in layer.blocks:
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def exact_float32() -> None:
    """No TF32 anywhere (timm's patch embedding is a convolution, which cuDNN would run in
    TF32 by default): the comparison is between summation orders, not precisions."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def worker(rank: int, init_file: str, out_dir: str, interpret: bool, device_type: str) -> None:
    """One process: for each wrapper, a fresh model, half of the global batch, one step;
    results saved for the test. device_type "cuda": NCCL, GPU ``rank``; "cpu": gloo."""
    assert INTERPRET == interpret, "TRITON_INTERPRET did not reach the worker"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        exact_float32()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD_SIZE)
    try:
        x, y = global_batch()
        for kind in WRAPPERS:
            model = tiny_swin(drop_path_rate=0.0).to(device)  # seeded: the same weights in every process
            wrapped = wrap(model, kind, device_type)
            attention = [(status.name, is_patched(wrapped.get_submodule(status.name)))
                         for status in patch_report(wrapped).modules]
            result = train_step(wrapped, model, x.chunk(WORLD_SIZE)[rank].to(device),
                                y.chunk(WORLD_SIZE)[rank].to(device))
            result = on_cpu(result)
            torch.save(dict(result, attention=attention, wrapper=type(wrapped).__name__), f"{out_dir}/{kind}-{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Results saved: leave without Python's shutdown, which FSDP2 over gloo can abort (see
    # exit_before_interpreter_shutdown in examples/train_ddp.py); an exception above still
    # propagates and fails the test.
    os._exit(0)


def run_and_compare(tmp_path, device_type: str) -> None:
    """DDP and FSDP2 (one pair of processes for both, to start them once): every attention
    module inside the wrapper is patched, and each process's gradients and updated weights
    are those of one process (on GPU 0, for "cuda") on the whole batch."""
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path), INTERPRET, device_type), nprocs=WORLD_SIZE)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        exact_float32()
    x, y = global_batch()
    model = patch_model(tiny_swin(drop_path_rate=0.0).to(device))
    initial_head = model.head.fc.weight.detach().cpu().clone()
    expected = train_step(model, model, x.to(device), y.to(device))
    expected = on_cpu(expected)
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


@pytest.mark.long
def test_one_step_matches_single_process(tmp_path):
    run_and_compare(tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_one_step_on_two_gpus_matches_one_gpu(tmp_path):
    """The same under NCCL, one GPU per process, with the compiled kernels."""
    run_and_compare(tmp_path, "cuda")


# ------------------------------------------------------------------------------- example
def docstring_cpu_command() -> List[str]:
    """The example's CPU command, from its docstring: the arguments after ``torchrun``,
    optional ``[--fsdp]`` left out."""
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    match = re.search(r"TRITON_INTERPRET=1 torchrun (.*?)\s*\[--fsdp\]", doc.replace("\\\n", " "), re.S)
    assert match, "the example's docstring lost its CPU command"
    return shlex.split(match.group(1))


@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
@pytest.mark.long
def test_example_runs_on_cpu(extra):
    """The docstring's CPU command, one step, with DDP and with FSDP2: exit code 0, and rank
    0 reports the patch and the step."""
    command = [sys.executable, "-m", "torch.distributed.run", *docstring_cpu_command(), "--steps", "1", *extra]
    assert "--device" in command and "--standalone" in command  # standalone: a free port, not 29500
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "patched 4 of 4 attention modules" in done.stdout and "attention computed by " in done.stdout
    assert re.search(r"step +0 +loss \d+\.\d+ +\d+\.\d images/s", done.stdout), done.stdout
