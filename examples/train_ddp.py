"""Data-parallel training of a patched timm Swin under torchrun: DistributedDataParallel or
FSDP2.

On GPUs (NCCL, one GPU per process, bfloat16 autocast):

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py [--fsdp] [--steps 20] [--model NAME]

On a CPU (gloo, float32), a model small enough to train in under a minute on 2 cores (56 =
4 x 14 pixels gives whole 7x7 windows, without padding); TRITON_INTERPRET=1 runs the Triton
kernels under the interpreter, slowly (without it the patched modules compute in PyTorch):

    TRITON_INTERPRET=1 torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --device cpu \\
        --img-size 56 --embed-dim 32 --depths 2 2 --num-heads 2 4 --num-classes 10 --batch 2 --steps 2 [--fsdp]

(``python -m torch.distributed.run`` is the same as ``torchrun``; ``--standalone`` picks a
free local port. Across nodes, use torchrun's ``--nnodes`` and ``--rdzv-endpoint`` instead.)

The model is patched with ``timm_flashwin.patch_model`` before it is wrapped: with FSDP2
every transformer block (the parent of a window-attention module) is sharded, then the
whole model. The data are synthetic: a few fixed batches of random images and labels per
process, drawn from a seeded generator, cycled; nothing is downloaded. Rank 0 prints each
step's loss (averaged over the processes) and the throughput in images per second over all
processes.
"""
import argparse
import os
import sys
import time
import warnings
from typing import List, Optional, Tuple

import timm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import timm_flashwin

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import fully_shard


#: what torchrun sets in each process's environment, and init_process_group reads
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The options; outside torchrun, a usage error saying how to launch (exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224", help="timm model name")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DistributedDataParallel")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="images per process and step")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: NCCL, a GPU per process; cpu: gloo")
    parser.add_argument("--img-size", type=int, default=None, help="image side in pixels; None: the model's own")
    parser.add_argument("--num-classes", type=int, default=1000, help="classifier outputs")
    # Overrides of the model's architecture, for a model small enough to train on a CPU.
    parser.add_argument("--embed-dim", type=int, default=None, help="the model's width; None: its own")
    parser.add_argument("--depths", type=int, nargs="+", default=None, help="blocks per stage; None: its own")
    parser.add_argument("--num-heads", type=int, nargs="+", default=None, help="heads per stage; None: its own")
    args = parser.parse_args(argv)
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        parser.error(f"not launched by torchrun ({', '.join(missing)} not set); launch it as "
                     f"torchrun --standalone --nproc_per_node=2 {sys.argv[0]} ... (the module docstring: "
                     f"a small CPU setting too)")
    return args


def setup(device_type: str) -> torch.device:
    """Join the process group that torchrun describes in the environment: NCCL with one
    GPU per process (LOCAL_RANK), or gloo on CPUs."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The timm model, patched. Every process seeds the same initialization: DDP would
    broadcast rank 0's weights anyway, but FSDP2 shards each process's own copy."""
    overrides = dict(embed_dim=args.embed_dim, depths=args.depths, num_heads=args.num_heads, img_size=args.img_size)
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items() if v is not None}
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=args.num_classes, **kwargs).to(device)
    timm_flashwin.patch_model(model)
    if dist.get_rank() == 0:
        report = timm_flashwin.patch_report(model)
        print(f"{report.summary()}; {report.road_line()}", flush=True)  # what computes the patched attention
    return model


def shard(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2: each transformer block is one unit (its parameters are gathered for its
    forward and backward only), then the root holds what is left (embedding, head). The
    mesh names the device type: FSDP2's default would take the GPUs of a machine that has
    some, also for a run on its CPUs."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    report = timm_flashwin.patch_report(model)
    blocks = sorted({status.name.rsplit(".", 1)[0] for status in report.modules})
    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=mesh)
    # timm's blocks end with a reshape, so FSDP2 warns that they return a view; nothing
    # modifies those outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return fully_shard(model, mesh=mesh)


def synthetic_batches(args: argparse.Namespace, img_size: Tuple[int, int], count: int = 4
                      ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed batches of random images and labels, different on every process."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [(torch.randn(args.batch, 3, *img_size, generator=gen),
             torch.randint(0, args.num_classes, (args.batch,), generator=gen)) for _ in range(count)]


def exit_before_interpreter_shutdown() -> None:
    """Leave now, skipping Python's shutdown: with FSDP2 over gloo (seen on torch 2.14),
    DTensor's caches keep the process group, and so gloo's worker threads, alive past
    destroy_process_group. A worker that frees a finished collective's tensors needs the
    GIL; if the interpreter is shutting down just then, CPython ends that thread inside a
    destructor and the process aborts ("terminate called without an active exception"),
    in about one run in five. Everything is done and printed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, device)
    img_size = tuple(model.patch_embed.img_size)  # the model's own, or --img-size
    model = shard(model, device) if args.fsdp else nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = synthetic_batches(args, img_size)
    amp = device.type == "cuda"  # bfloat16 autocast, float32 weights and optimizer state

    model.train()
    rates = []
    for step in range(args.steps):
        x, y = (t.to(device, non_blocking=True) for t in batches[step % len(batches)])
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)  # a sum: gloo has no average
        mean_loss = total_loss.item() / world  # .item() waits for the device: the step's time is complete
        elapsed = time.perf_counter() - start
        rates.append(args.batch * world / elapsed)
        if rank == 0:
            print(f"step {step:4d}  loss {mean_loss:.4f}  {rates[-1]:8.1f} images/s", flush=True)
    if rank == 0 and args.steps > 3:  # the first steps compile kernels and warm up the allocator
        steady = sorted(rates[3:])
        print(f"median of steps 3..{args.steps - 1}: {steady[len(steady) // 2]:.1f} images/s on {world} "
              f"process(es), {args.batch} images per process", flush=True)
    dist.destroy_process_group()
    if args.fsdp and device.type == "cpu":
        exit_before_interpreter_shutdown()


if __name__ == "__main__":
    main()
