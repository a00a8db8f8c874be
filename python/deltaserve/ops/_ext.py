"""Loads the optional `deltaserve._C` extension once and says whether an op can use it."""

from __future__ import annotations

import functools
import os

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


def ops():
    """The extension's op namespace, `torch.ops.deltaserve`. The op wrappers reach the kernels
    only through here and `use_extension`, which tests/ops/kernels_emu.py swaps for the CPU
    emulation of the kernels (`torch.ops.deltaserve_emu`, on CPU tensors)."""
    return torch.ops.deltaserve


def count_from_env(name: str, default: int, most: int, value: str | None = None) -> int:
    """An integer 0..`most` from environment variable `name` (or `value` when given; unset or
    empty: `default`); ValueError naming the variable otherwise. For kernel size limits that
    A/B runs set before starting the process (0 turns the kernel off)."""
    value = os.environ.get(name) if value is None else value
    if value is None or value == "":
        return default
    try:
        count = int(value)
    except ValueError:
        count = -1
    if not 0 <= count <= most:
        raise ValueError(f"{name} must be an integer in 0..{most}, got {value!r}")
    return count


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_HEAD_DIMS = (32, 64, 128, 256)  # head_k_dim values the GDN kernels are compiled for
KERNEL_CONV_WIDTH = 4


def same_kernel_dtype(*tensors: torch.Tensor | None) -> bool:
    """True when the given tensors (None skipped) share one dtype the kernels are compiled for."""
    dtypes = {t.dtype for t in tensors if t is not None}
    return len(dtypes) == 1 and dtypes.pop() in KERNEL_DTYPES


def vector_rows(t: torch.Tensor, inner: int, align: int) -> bool:
    """Last `inner` dims dense, 16-byte aligned start, outer strides multiples of `align`
    elements, outer dims nested evenly (what the kernels' vector loads assume)."""
    expect = 1
    for d in range(t.dim() - 1, t.dim() - inner - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return False
        expect *= t.shape[d]
    outer = range(t.dim() - inner)
    if any(t.stride(d) % align for d in outer):
        return False
    if any(t.stride(d) != t.shape[d + 1] * t.stride(d + 1) for d in range(t.dim() - inner - 1)):
        return False
    return t.data_ptr() % 16 == 0
