"""The host snapshot bank: a second tier of GDN snapshot slots in (pinned) host memory.

The prefix cache moves the device snapshots it evicts here instead of dropping them, and
loads one back into a request's live device slot when a match ends on it. Host slots have
the per-slot layout of GDNStatePool, so a copy either way is one `ops.snapshot_copy`.

Slot ids are 0..num_slots-1: host memory needs no padding sink. They are a namespace of
their own, never mixed with device slot ids: the radix tree keeps them in `host_slot`, apart
from the device `snapshot_slot`.

Ordering on CUDA. Every copy is enqueued on the bank's own copy stream, so the host thread
never waits and the copies of one bank run in issue order (a host slot freed and handed out
again is written only after every earlier copy of it has read it). Each copy is fenced by
two events: the copy stream first waits for the work enqueued so far on the current
(compute) stream, so a store reads the final state and a load cannot overwrite a slot that
earlier kernels still read; then the compute stream waits for the copy, so later kernels see
a loaded state and cannot overwrite a device slot (freed after its store) before the store
has read it. On CPU every copy is synchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from deltaserve.cache.gdn_slots import GDNSlots
from deltaserve.ops.snapshot import snapshot_copy

if TYPE_CHECKING:
    from deltaserve.cache.state_pool import GDNStatePool


class BankUsage(NamedTuple):
    n_used: int  # host slots allocated
    n_slots: int  # host slots in all
    bytes_used: int  # host bytes of the allocated slots
    bytes_total: int  # host bytes of the bank


class HostSnapshotBank(GDNSlots):
    """Slots 0..N-1 of `.recurrent` [L, N, HV, V, K] fp32 and `.conv` [L, N, W-1, D].

    `device` is where the state pools it exchanges with live: on CUDA the tensors are pinned
    (page-locked, so copies are truly asynchronous) and the bank owns a copy stream on that
    device; elsewhere they are plain CPU tensors and copies are synchronous. `conv_dtype` is
    the model's activation dtype, as in GDNStatePool. Bytes: see `bytes_per_slot`.
    """

    __slots__ = ("device", "_stream")

    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, head_v_dim: int,
                 head_k_dim: int, conv_dim: int, conv_width: int,
                 device: torch.device | str = "cpu",
                 conv_dtype: torch.dtype = torch.float32) -> None:
        assert num_slots >= 0
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        if on_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._init_slots(num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim, conv_dim,
                         conv_width, conv_dtype, first=0, noun="host slot",
                         what="host snapshot bank", pin_memory=on_cuda)
        self._stream = torch.cuda.Stream(device=self.device) if on_cuda else None

    @classmethod
    def like(cls, state_pool: GDNStatePool, num_slots: int) -> HostSnapshotBank:
        """A bank of `num_slots` host slots with `state_pool`'s per-slot shapes and dtypes,
        pinned when the pool is on CUDA."""
        n_layers, _, hv, v, k = state_pool.recurrent.shape
        _, _, window, conv_dim = state_pool.conv.shape
        return cls(n_layers, num_slots, hv, v, k, conv_dim, window + 1,
                   state_pool.recurrent.device, state_pool.conv.dtype)

    def usage(self) -> BankUsage:
        used, per = self.num_allocated, self.bytes_per_slot
        return BankUsage(used, self.num_slots, used * per, self.num_slots * per)

    # ---- copies -------------------------------------------------------------------------
    def store(self, pool: GDNStatePool, dev_slot: int, host_slot: int) -> None:
        """Copy every layer's state of allocated device `dev_slot` of `pool` into allocated
        `host_slot`. On CUDA: asynchronous, after the work enqueued so far on the current
        stream, and before whatever is enqueued on it next (so `dev_slot` may be freed and
        reused at once). Host reads of the bank tensors need `synchronize()` first."""
        assert pool.is_allocated(dev_slot), f"store from device slot {dev_slot}, not allocated"
        assert self.is_allocated(host_slot), f"store to host slot {host_slot}, not allocated"
        pool.settle()
        self._copy((pool.recurrent, pool.conv), dev_slot, (self.recurrent, self.conv), host_slot)

    def load(self, host_slot: int, pool: GDNStatePool, dev_slot: int) -> None:
        """Copy every layer's state of allocated `host_slot` into allocated device `dev_slot`
        of `pool`. On CUDA: asynchronous, after the work enqueued so far on the current stream
        (which may still read `dev_slot`'s old contents), and before the next kernels on it
        (which see the loaded state). `host_slot` is unchanged and may be freed at once."""
        assert self.is_allocated(host_slot), f"load from host slot {host_slot}, not allocated"
        assert pool.is_allocated(dev_slot), f"load to device slot {dev_slot}, not allocated"
        pool.settle()
        self._copy((self.recurrent, self.conv), host_slot, (pool.recurrent, pool.conv), dev_slot)

    def _copy(self, src: tuple[torch.Tensor, torch.Tensor], src_slot: int,
              dst: tuple[torch.Tensor, torch.Tensor], dst_slot: int) -> None:
        if self._stream is None:
            snapshot_copy(src, [src_slot], dst, [dst_slot])
            return
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self._stream.wait_event(ready)
        snapshot_copy(src, [src_slot], dst, [dst_slot], stream=self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)

    def synchronize(self) -> None:
        """Block the host until every copy enqueued so far has finished (tests, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()

    def check_integrity(self) -> None:
        """Every slot 0..num_slots-1 is exactly one of free / allocated; tensors keep their
        shapes; pinned when serving a CUDA pool."""
        super().check_integrity()
        assert not self.recurrent.is_cuda and not self.conv.is_cuda
        if self._stream is not None:
            assert self.recurrent.is_pinned() and self.conv.is_pinned()
