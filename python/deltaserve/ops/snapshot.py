"""Copies whole GDN states (every layer of a slot) between pools: device or pinned host."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.ops._ext import extension_loaded

Pools = tuple[torch.Tensor, torch.Tensor]


def _slot_list(slots: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(slots, torch.Tensor):
        if slots.is_cuda:
            raise ValueError("snapshot_copy takes slot ids on the host (a list or CPU tensor)")
        return [int(s) for s in slots.tolist()]
    return [int(s) for s in slots]


def snapshot_copy(src: Pools, src_slots: torch.Tensor | Sequence[int], dst: Pools,
                  dst_slots: torch.Tensor | Sequence[int],
                  stream: torch.cuda.Stream | None = None) -> None:
    """Copy every layer of src slot src_slots[j] to dst slot dst_slots[j], for j < M.

    src, dst: (recurrent [L, S, HV, V, K] fp32, conv [L, S, W-1, D]) pools with equal per-slot
    shapes and dtypes (S may differ); each on a CUDA device or in pinned host memory.
    src_slots, dst_slots: M slot ids on the host (list or CPU int tensor).
    With a CUDA side the copy is enqueued on `stream` (default: the current stream) and the
    call returns without waiting; record an event on that stream to know when it is done, and
    keep the host buffers alive and untouched until then. CPU-only pools copy synchronously.
    Device->device copies run as one copy kernel per 64 slots in no fixed order, so a
    destination slot listed twice, or (within one pool) a slot both read and written, is
    refused on every path. Raises ValueError on mismatched shapes/dtypes, device slot tensors,
    unequal M, slots outside [0, S) or such overlap.
    """
    s_list, d_list = _slot_list(src_slots), _slot_list(dst_slots)
    if len(s_list) != len(d_list):
        raise ValueError(f"{len(s_list)} source slots but {len(d_list)} destination slots")
    for a, b in zip(src, dst, strict=True):
        if a.dtype != b.dtype or a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
            raise ValueError(f"pools differ: {a.dtype} {tuple(a.shape)} vs "
                             f"{b.dtype} {tuple(b.shape)}")
    if not s_list:
        return
    for name, slot_ids, pool in (("source", s_list, src[0]), ("destination", d_list, dst[0])):
        if min(slot_ids) < 0 or max(slot_ids) >= pool.shape[1]:
            raise ValueError(f"snapshot_copy: {name} slots must lie in [0, {pool.shape[1]}), "
                             f"got {slot_ids}")
    if len(set(d_list)) != len(d_list):
        raise ValueError("snapshot_copy: a destination slot is listed twice")
    if src[0].data_ptr() == dst[0].data_ptr() and set(s_list) & set(d_list):
        raise ValueError("snapshot_copy: within one pool a slot is both read and written")
    on_cuda = any(t.is_cuda for t in (*src, *dst))
    if not on_cuda:
        for a, b in zip(src, dst, strict=True):
            b[:, d_list] = a[:, s_list]
        return
    stream = stream if stream is not None else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for a, b in zip(src, dst, strict=True):
            if extension_loaded():  # d2d: a copy kernel; with the host: a 2-D memcpy per slot
                torch.ops.deltaserve.snapshot_copy(a, b, s_list, d_list)
                continue
            for s, d in zip(s_list, d_list, strict=True):
                b[:, d].copy_(a[:, s], non_blocking=True)
