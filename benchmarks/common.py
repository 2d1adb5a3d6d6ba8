"""What the benchmark scripts share."""
import json
import os
from collections import defaultdict


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` (creating its folder); scripts call it after every
    measurement, so that a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def cuda_kernel_times(prof) -> dict:
    """{kernel name: [launches, GPU us]} summed over the CUDA events of a finished
    torch.profiler run."""
    import torch
    kernels = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time_total
    return dict(kernels)
