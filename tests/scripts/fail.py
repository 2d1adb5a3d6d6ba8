"""Fails as a training script might: an exception raised in a function while handling
another. tests/test_factory.py compares what python prints for it with what
``timm-flashwin run`` prints."""
import sys


def load(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise RuntimeError(f"cannot read {path}") from exc


print("arguments:", sys.argv[1:])
load(sys.argv[1])
