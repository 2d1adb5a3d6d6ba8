"""Test setup. Without a CUDA device the Triton kernels run under the interpreter on CPU
tensors; TRITON_INTERPRET must be set before triton is imported (timm imports it), and
``import torch`` alone does not import it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
#: Where the kernel tests run: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
