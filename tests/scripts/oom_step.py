"""tests/test_out_of_memory.py's GPU runs that take the whole GPU, each in a fresh process (the
kernels compile and load in the step under test). Prints one JSON line.

    python tests/scripts/oom_step.py step --variant flashwin          # a training step on a full GPU
    python tests/scripts/oom_step.py batch-finder --variant flashwin  # accelerate's find_executable_batch_size
"""
import argparse
import json
import os
import sys

import timm
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout
import timm_flashwin  # noqa: E402

MODEL = "swin_tiny_patch4_window7_224"


def fill(leave_bytes: int) -> list:
    """Live tensors holding all of the GPU's free memory but ``leave_bytes`` (within 2 MiB)."""
    torch.cuda.empty_cache()
    held, free = [], torch.cuda.mem_get_info()[0] - leave_bytes
    for chunk in (2 ** 30, 2 ** 28, 2 ** 26, 2 ** 24, 2 ** 22, 2 ** 21):
        while free >= chunk:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
            free -= chunk
    return held


def warm_libraries() -> None:
    """cuBLAS's and cuDNN's handles made while memory is free (made on a full GPU, they fail
    with their own errors, CUBLAS_STATUS_ALLOC_FAILED, for timm and patched alike)."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        net(torch.randn(2, 3, 8, 8, device="cuda")).float().sum().backward()
    torch.cuda.synchronize()


def model_and_step(variant: str):
    model = timm.create_model(MODEL).cuda().train()
    if variant == "flashwin":
        timm_flashwin.patch_model(model, strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: int, images=None) -> float:
        images = torch.randn(batch, 3, 224, 224, device="cuda") if images is None else images
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["step", "batch-finder"])
    parser.add_argument("--variant", choices=["timm", "flashwin"], default="flashwin")
    parser.add_argument("--leave-mib", type=float, default=None,
                        help="GPU memory left free (default: step 256, batch-finder 6144)")
    args = parser.parse_args()
    step = model_and_step(args.variant)
    warm_libraries()
    if args.mode == "step":
        images = torch.randn(64, 3, 224, 224, device="cuda")  # the step's input exists before the GPU fills
        held = fill(int((args.leave_mib or 256) * 2 ** 20))
        try:
            step(64, images)
            result = dict(error_type=None, message="")
        except Exception as error:  # what the step raised: the test reads its type and text
            result = dict(error_type=type(error).__name__, message=str(error)[:2000])
        del held
    else:
        from accelerate.utils import find_executable_batch_size
        held, tried = fill(int((args.leave_mib or 6144) * 2 ** 20)), []

        @find_executable_batch_size(starting_batch_size=1024)
        def train(batch_size: int) -> float:
            tried.append(batch_size)
            return [step(batch_size) for _ in range(2)][-1]
        loss = train()
        result = dict(tried=tried, finished=bool(torch.isfinite(torch.tensor(loss))), loss=loss)
        del held
    print(json.dumps(dict(result, variant=args.variant, torch=torch.__version__)))


if __name__ == "__main__":
    main()
