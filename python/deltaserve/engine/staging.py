"""Host -> device copies of a step's small inputs without a blocking copy.

`torch.tensor(list, device="cuda")` copies from pageable memory: the host waits for the copy
(and so for the GPU work queued before it). Here values go into pinned host memory first and
are copied with `non_blocking=True`, so the host returns at once and the copy runs in stream
order before the step's kernels. torch's caching host allocator keeps a pinned block alive
until the copy that reads it has finished (it records an event on the stream), so a block is
never overwritten under a copy still in flight.
"""

from __future__ import annotations

import numpy as np
import torch


def host_tensor(values, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """values (list or numpy array) -> a host tensor of `dtype`, pinned when `pin`."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=_NUMPY[dtype]))
    return t.pin_memory() if pin else t


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new device tensor of `values` (1-D list or numpy array), copied without blocking."""
    pin = device.type == "cuda"
    return host_tensor(values, dtype, pin).to(device, non_blocking=pin)


def copy_into(dst: torch.Tensor, values) -> None:
    """dst[:len(values)] <- values (a static buffer, e.g. a CUDA graph's input), without
    blocking; the rest of dst is left as it is."""
    pin = dst.is_cuda
    src = host_tensor(values, dst.dtype, pin)
    dst[:src.shape[0]].copy_(src, non_blocking=pin)


def row_positions(starts: list[int], rows: int | list[int]) -> np.ndarray:
    """Positions of each request's new rows, concatenated: start_i .. start_i + rows_i - 1
    (rows: one count for all, or one per request) -> int64 [sum rows]."""
    starts_a = np.asarray(starts, dtype=np.int64)
    counts = np.full(len(starts), rows, dtype=np.int64) if isinstance(rows, int) \
        else np.asarray(rows, dtype=np.int64)
    if counts.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts)
    return np.repeat(starts_a, counts) + offsets


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
