"""Loads the optional `deltaserve._C` extension once and says whether an op can use it."""

from __future__ import annotations

import functools

import torch


@functools.cache
def extension_loaded() -> bool:
    """True when `deltaserve._C` was built and registered `torch.ops.deltaserve`."""
    try:
        from deltaserve import _C  # noqa: F401  (registers the ops on import)
    except ImportError:
        return False
    return True


def use_extension(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA (or ROCm) device and the extension is built."""
    return all(t.is_cuda for t in tensors) and extension_loaded()
