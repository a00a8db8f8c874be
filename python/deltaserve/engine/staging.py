"""Host -> device copies of a step's small inputs without a blocking copy.

`torch.tensor(list, device="cuda")` copies from pageable memory: the host waits for the copy
(and so for the GPU work queued before it). Here values go into pinned host memory first and
are copied with `non_blocking=True`, so the host returns at once and the copy runs in stream
order before the step's kernels.

Pinning a fresh host tensor per copy costs ~40 us of host time on the H200 machine (the
pointer-attribute query and the host allocator; 5 such copies were most of a decode step's host
gap), so step inputs are staged in a `PinnedRing`: one pinned buffer allocated once, split in
two halves used in turn. Leaving a half records an event after the copies that read it; coming
back to it waits on that event (long complete in steady state: a half holds hundreds of steps'
inputs), so a region is never rewritten under a copy still in flight. This holds for one thread
issuing the copies (the engine's); an input larger than a half gets a fresh pinned tensor,
which torch's caching host allocator keeps until its copy is done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


class PinnedRing:
    """Host staging memory for non-blocking host -> device copies (see the module doc).

    capacity: bytes (two halves of capacity // 2). pin: page-locked memory (a CUDA device);
    new_event() -> an object with record() and synchronize() (torch.cuda.Event by default; the
    CPU tests pass a recorder). Thread-safe. `stage` returns None for an array larger than a
    half (the caller pins a fresh tensor instead).
    """

    ALIGN = 256  # bytes: every region starts on a 256-byte boundary (DMA-friendly)

    def __init__(self, capacity: int = 1 << 22, pin: bool = True,
                 new_event: Callable[[], object] | None = None) -> None:
        self.half = capacity // 2 // self.ALIGN * self.ALIGN
        self.buf = torch.empty(2 * self.half, dtype=torch.uint8, pin_memory=pin)
        self.bytes = self.buf.numpy()
        self.new_event = new_event or torch.cuda.Event
        self.events: list[object | None] = [None, None]  # recorded on leaving each half
        self.cur, self.offset = 0, 0
        self.lock = threading.Lock()

    def stage(self, values: np.ndarray) -> torch.Tensor | None:
        """A host tensor in the ring holding `values` (its dtype and shape), or None."""
        n = values.nbytes
        if n > self.half:
            return None
        with self.lock:
            start = self._region(n)
            dst = self.bytes[start:start + n].view(values.dtype).reshape(values.shape)
            dst[...] = values
            return self.buf[start:start + n].view(_TORCH[values.dtype.type]).view(values.shape)

    def _region(self, n: int) -> int:
        if self.offset + n > (self.cur + 1) * self.half:  # next half: wait for its old copies
            ev = self.new_event()
            ev.record()
            self.events[self.cur] = ev
            self.cur ^= 1
            self.offset = self.cur * self.half
            if self.events[self.cur] is not None:
                self.events[self.cur].synchronize()
        start = self.offset
        self.offset += -(-n // self.ALIGN) * self.ALIGN
        return start


_rings: dict[int, PinnedRing] = {}
_rings_lock = threading.Lock()


class CopyBack:
    """Device -> host copies of a launched step's results that the host reads one call later
    (overlap scheduling): two pinned buffers of `shape` used in turn, each copy followed by an
    event. A buffer is written again two launches later, after the host read it: each call
    lands the step launched before it returns. On a CPU device plain memory and no event (the
    copy is done at once). int64 buffers, allocated on the first copy."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.shape, self.pin = shape, device.type == "cuda"
        self._bufs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy `src` (int64, each dimension at most `shape`'s) into the next buffer without
        blocking; returns (its host view, the event to synchronize on before reading it: None
        on a CPU)."""
        if not self._bufs:
            self._bufs = [torch.empty(self.shape, dtype=torch.long, pin_memory=self.pin)
                          for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)] if self.pin else []
        self._turn ^= 1
        host = self._bufs[self._turn][tuple(slice(0, n) for n in src.shape)]
        event = self._events[self._turn] if self._events else None
        host.copy_(src, non_blocking=event is not None)
        if event is not None:
            event.record()
        return host, event


def _ring(device: torch.device) -> PinnedRing:
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _rings.get(index)
    if ring is None:
        with _rings_lock:
            ring = _rings.get(index)
            if ring is None:
                with torch.cuda.device(index):  # events recorded on this device's stream
                    ring = _rings[index] = PinnedRing()
    return ring


def staged(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of `values` (list or numpy array) for a non-blocking copy to `device`:
    a pinned region of the device's PinnedRing when `device` is CUDA, else a plain tensor.
    Valid until the copy that reads it has been issued (the ring keeps it for that copy)."""
    arr = np.ascontiguousarray(values, dtype=_NUMPY[dtype])
    if device.type != "cuda":
        return torch.from_numpy(arr)
    out = _ring(device).stage(arr)  # one process drives one GPU: its current stream copies
    return out if out is not None else torch.from_numpy(arr).pin_memory()


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new device tensor of `values` (1-D list or numpy array), copied without blocking."""
    pin = device.type == "cuda"
    return staged(values, dtype, device).to(device, non_blocking=pin)


def copy_into(dst: torch.Tensor, values) -> None:
    """dst[:len(values)] <- values (a static buffer, e.g. a CUDA graph's input), without
    blocking; the rest of dst is left as it is."""
    src = staged(values, dst.dtype, dst.device)
    dst[:src.shape[0]].copy_(src, non_blocking=dst.is_cuda)


def row_positions(starts: list[int], rows: int | list[int]) -> np.ndarray:
    """Positions of each request's new rows, concatenated: start_i .. start_i + rows_i - 1
    (rows: one count for all, or one per request) -> int64 [sum rows]."""
    starts_a = np.asarray(starts, dtype=np.int64)
    if isinstance(rows, int):  # every decode / verify step: no repeat over counts (4x faster)
        return (starts_a[:, None] + np.arange(rows, dtype=np.int64)).reshape(-1)
    counts = np.asarray(rows, dtype=np.int64)
    if counts.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts)
    return np.repeat(starts_a, counts) + offsets


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}
