"""The GDN state pool: per slot, every GDN layer's recurrent state and conv window.

A slot is either a running request's live state, a track slot (a snapshot being taken during
prefill) or a prefix-cache snapshot. Slot 0 is a padding sink: kernels may write it (padded
rows of a CUDA graph batch point there), so it is never handed out.
"""

from __future__ import annotations

import torch

from deltaserve.cache.gdn_slots import GDNSlots
from deltaserve.ops.snapshot import snapshot_copy


class GDNStatePool(GDNSlots):
    """Slots 1..num_slots-1 of `.recurrent` [L, S, HV, V, K] fp32 and `.conv` [L, S, W-1, D]
    on `device` (layout and allocator: GDNSlots). `conv_dtype` is the model's activation
    dtype. Slot 0 is the padding sink."""

    __slots__ = ()

    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, head_v_dim: int,
                 head_k_dim: int, conv_dim: int, conv_width: int,
                 device: torch.device | str = "cpu",
                 conv_dtype: torch.dtype = torch.float32) -> None:
        assert num_slots >= 1, "num_slots counts the padding slot 0, so it is at least 1"
        self._init_slots(num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim, conv_dim,
                         conv_width, conv_dtype, first=1, noun="slot", what="GDN state pool",
                         device=device)

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
