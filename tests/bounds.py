"""An address check for kernels under Triton's interpreter: inside ``views_checked()``, every
address a kernel loads or stores where its mask is true must lie within the view of one of
the launch's tensor arguments (from its first element to its last, by its strides). A GPU
faults on some such accesses and silently reads others, by where the caching allocator put
the tensors; the interpreter reads host memory and faults on none: this check sees them all.

It wraps two methods of Triton's interpreter (``GridExecutor.__call__`` for the launch's
tensors, ``InterpreterBuilder.create_masked_load`` / ``create_masked_store`` for the addresses);
a Triton without them skips the test that uses it."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch


def _views(tensors) -> List[Tuple[int, int]]:
    spans = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            first = t.data_ptr()
            last = first + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) * t.element_size()
            spans.append((first, last + t.element_size()))
    return spans


@contextlib.contextmanager
def views_checked() -> Iterator[Dict[Tuple[str, str], int]]:
    """Yields {(kernel, "load" | "store"): number of addresses outside every view}, filled as
    the kernels run (empty: none)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    executor, builder = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpreterBuilder", None)
    if not all(hasattr(cls, name) for cls, name in ((executor, "__call__"), (builder, "create_masked_load"),
                                                    (builder, "create_masked_store"))):
        pytest.skip("this Triton's interpreter has no GridExecutor / InterpreterBuilder to wrap")
    outside: Dict[Tuple[str, str], int] = {}
    launch = {"kernel": "", "views": []}
    call, load, store = executor.__call__, builder.create_masked_load, builder.create_masked_store

    def check(ptrs, mask, what):
        addresses = ptrs.data.astype(np.uint64)
        taken = np.broadcast_to(mask.data, addresses.shape).astype(bool)
        addresses = addresses[taken]
        inside = np.zeros(addresses.shape, bool)
        for first, end in launch["views"]:
            inside |= (addresses >= first) & (addresses < end)
        if not inside.all():
            key = (launch["kernel"], what)
            outside[key] = outside.get(key, 0) + int((~inside).sum())

    def checked_call(self, *args, **kwargs):
        launch["kernel"], launch["views"] = self.fn.__name__, _views(list(args) + list(kwargs.values()))
        return call(self, *args, **kwargs)

    def checked_load(self, ptrs, mask, *args, **kwargs):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *args, **kwargs)

    def checked_store(self, ptrs, value, mask, *args, **kwargs):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    executor.__call__, builder.create_masked_load, builder.create_masked_store = (checked_call, checked_load,
                                                                                  checked_store)
    try:
        yield outside
    finally:
        executor.__call__, builder.create_masked_load, builder.create_masked_store = call, load, store
