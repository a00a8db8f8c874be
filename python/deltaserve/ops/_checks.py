"""Argument checks shared by the op wrappers: shapes and dtypes (metadata only, on every path),
and index values where reading them costs no host synchronisation (CPU tensors, which the
reference path reads anyway). On CUDA the index values are the caller's contract
(docs/interfaces.md): checking them there would stall the stream on every call.

Every check raises ValueError naming the argument, what it must be and what it got.
"""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def shape(name: str, t: torch.Tensor, expect: tuple[int | None, ...]) -> None:
    """t.shape must equal `expect` (None: any size in that dim)."""
    if t.dim() != len(expect) or any(e is not None and s != e for s, e in zip(t.shape, expect)):
        want = ", ".join("*" if e is None else str(e) for e in expect)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")


def floating(name: str, t: torch.Tensor) -> None:
    """t must hold floating-point values (the ops compute in fp32 and cast back)."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def index(name: str, t: torch.Tensor, n: int | None = None) -> int:
    """t must be an int32/int64 vector [n] (n None: any length); returns its length."""
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")
    shape(name, t, (n,))
    return t.shape[0]


def in_range(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    """On CPU, every value of t must lie in [lo, hi); on other devices nothing is read."""
    if t.is_cuda or t.numel() == 0:
        return
    low, high = int(t.min()), int(t.max())
    if low < lo or high >= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}), got values from {low} to {high}")


def slots(t: torch.Tensor, n: int | None, num_slots: int, name: str = "slots") -> int:
    """index(t, n), and on CPU every slot id in [0, num_slots); returns the count."""
    count = index(name, t, n)
    in_range(name, t, 0, num_slots)
    return count


def seqlens(cu_seqlens: torch.Tensor, n: int, total: int) -> None:
    """cu_seqlens must be an int vector [n+1]; on CPU also 0, non-decreasing, ending at `total`
    (the packed tokens: rows past the end would be left unwritten)."""
    index("cu_seqlens", cu_seqlens, n + 1)
    if cu_seqlens.is_cuda:
        return
    b = cu_seqlens.tolist()
    if b[0] != 0 or b[-1] != total or any(x > y for x, y in zip(b, b[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the {total} packed tokens, got {b}")
