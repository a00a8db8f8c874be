"""What the GDN state pool (device) and the host snapshot bank share: the per-slot layout of
every GDN layer's recurrent state and conv window, and the slot allocator over it."""

from __future__ import annotations

import math

import torch

from deltaserve.cache.free_list import FreeList


class GDNSlots:
    """`.recurrent` [L, S, HV, V, K] fp32 and `.conv` [L, S, W-1, D] (`conv_dtype`), with slots
    `first..S-1` handed out by a FreeList (FIFO reuse, asserted frees).

    K is the last (contiguous) recurrent axis so a warp reduces over contiguous K; the conv
    window is channel-contiguous. Subclasses say where the tensors live.
    """

    __slots__ = ("num_layers", "num_slots", "recurrent", "conv", "_ids", "_what")

    def _init_slots(self, num_layers: int, num_slots: int, num_v_heads: int, head_v_dim: int,
                    head_k_dim: int, conv_dim: int, conv_width: int, conv_dtype: torch.dtype,
                    first: int, noun: str, what: str, **where) -> None:
        assert conv_width >= 2, "the conv window holds conv_width - 1 >= 1 rows"
        self.num_layers, self.num_slots = num_layers, num_slots
        self.recurrent = torch.zeros(num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim,
                                     dtype=torch.float32, **where)
        self.conv = torch.zeros(num_layers, num_slots, conv_width - 1, conv_dim,
                                dtype=conv_dtype, **where)
        self._ids = FreeList(num_slots, first=first, noun=noun)
        self._what = what

    @property
    def num_free(self) -> int:
        """Slots that `allocate` can hand out now."""
        return self._ids.num_free

    @property
    def num_allocated(self) -> int:
        """Slots handed out and not yet freed."""
        return self._ids.num_allocated

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes, all layers, recurrent plus conv."""
        # from the shape, not t[:, 0]: a bank of 0 slots has no slot to index
        return sum(t.shape[0] * math.prod(t.shape[2:]) * t.element_size()
                   for t in (self.recurrent, self.conv))

    def is_allocated(self, slot: int) -> bool:
        return self._ids.is_allocated(slot)

    def can_allocate(self, n: int = 1) -> bool:
        """Pure: whether `n` calls of `allocate()` would succeed."""
        return self._ids.can_allocate(n)

    def allocate(self) -> int:
        """Take one free slot (oldest freed first). Its contents are stale (a previous
        owner's state) until the owner writes it. Asserts `can_allocate(1)`."""
        assert self._ids.num_free, f"allocate() on a full {self._what}"
        return self._ids.allocate(1)[0]

    def free(self, slot: int) -> None:
        """Return an allocated slot (asserts it is: no double free, never a padding slot).
        The tensors are not touched; the contents stay readable but belong to nobody."""
        self._ids.free((slot,))

    def check_integrity(self) -> None:
        """Every slot is exactly one of free / allocated; the tensors keep their shapes."""
        self._ids.check_integrity()
        assert self.recurrent.shape[:2] == self.conv.shape[:2] == (self.num_layers,
                                                                  self.num_slots)
        assert self.recurrent.dtype == torch.float32
