"""The GDN state pool: per slot, every GDN layer's recurrent state and conv window.

A slot is either a running request's live state, a track slot (a snapshot being taken during
prefill) or a prefix-cache snapshot. Slot 0 is a padding sink: kernels may write it (padded
rows of a CUDA graph batch point there), so it is never handed out.
"""

from __future__ import annotations

import torch

from deltaserve.cache.free_list import FreeList
from deltaserve.ops.snapshot import snapshot_copy


class GDNStatePool:
    """Slots 1..num_slots-1 of `.recurrent` [L, S, HV, V, K] fp32 and `.conv` [L, S, W-1, D].

    K is the last (contiguous) recurrent axis so a warp reduces over contiguous K; the conv
    window is channel-contiguous. `conv_dtype` is the model's activation dtype.
    """

    __slots__ = ("num_layers", "num_slots", "recurrent", "conv", "_ids")

    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, head_v_dim: int,
                 head_k_dim: int, conv_dim: int, conv_width: int,
                 device: torch.device | str = "cpu",
                 conv_dtype: torch.dtype = torch.float32) -> None:
        assert num_slots >= 1, "num_slots counts the padding slot 0, so it is at least 1"
        assert conv_width >= 2, "the conv window holds conv_width - 1 >= 1 rows"
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.recurrent = torch.zeros(num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim,
                                     dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_layers, num_slots, conv_width - 1, conv_dim,
                                dtype=conv_dtype, device=device)
        self._ids = FreeList(num_slots, first=1, noun="slot")

    @property
    def num_free(self) -> int:
        """Slots that `allocate` can hand out now."""
        return self._ids.num_free

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes one slot takes, all layers, recurrent plus conv."""
        per = [t[:, 0].numel() * t.element_size() for t in (self.recurrent, self.conv)]
        return sum(per)

    @property
    def num_allocated(self) -> int:
        """Slots handed out and not yet freed."""
        return self._ids.num_allocated

    def is_allocated(self, slot: int) -> bool:
        return self._ids.is_allocated(slot)

    def can_allocate(self, n: int = 1) -> bool:
        """Pure: whether `n` calls of `allocate()` would succeed."""
        return self._ids.can_allocate(n)

    def allocate(self) -> int:
        """Take one free slot. Its contents are stale (a previous owner's state) until the
        caller writes it with `zero`, `copy` or a kernel. Asserts `can_allocate(1)`."""
        assert self._ids.num_free, "allocate() on a full GDN state pool"
        return self._ids.allocate(1)[0]

    def free(self, slot: int) -> None:
        """Return an allocated slot (asserts it is: no double free, never slot 0). The
        tensors are not touched; the slot's contents stay readable but belong to nobody."""
        self._ids.free((slot,))

    def zero(self, slot: int) -> None:
        """Write the initial (all-zero) GDN state of every layer into allocated `slot`."""
        assert self.is_allocated(slot), f"zero of slot {slot}, which is not allocated"
        self.recurrent[:, slot].zero_()
        self.conv[:, slot].zero_()

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """Copy every layer's state (recurrent and conv) of `src_slot` into `dst_slot`; both
        allocated. On CUDA the copy is enqueued on the current stream (ordered before later
        kernels on it); `src_slot` is unchanged."""
        assert self.is_allocated(src_slot), f"copy from slot {src_slot}, not allocated"
        assert self.is_allocated(dst_slot), f"copy to slot {dst_slot}, not allocated"
        if src_slot == dst_slot:
            return
        pools = (self.recurrent, self.conv)
        snapshot_copy(pools, [src_slot], pools, [dst_slot])

    def check_integrity(self) -> None:
        """Every slot 1..num_slots-1 is exactly one of free / allocated; slot 0 is neither;
        the tensors still have their pool shapes."""
        self._ids.check_integrity()
        assert self.recurrent.shape[:2] == self.conv.shape[:2] == (self.num_layers, self.num_slots)
        assert self.recurrent.dtype == torch.float32
