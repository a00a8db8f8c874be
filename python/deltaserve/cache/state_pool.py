"""The GDN state pool: per slot, every GDN layer's recurrent state and conv window.

A slot is either a running request's live state, a track slot (a snapshot being taken during
prefill) or a prefix-cache snapshot. Slot 0 is a padding sink: kernels may write it (padded
rows of a CUDA graph batch point there), so it is never handed out.

Deferred replay: after a verify step the accepted rows of each request are not applied to
its recurrent state at once (`defer_replay`). The next verify of the same requests in the same
order takes them (`take_pending`) and applies them in its own launch (gdn_verify with
pending rows), so a speculative step moves the state once instead of three times. Anything
else that touches the recurrent state first settles them (`settle`: one gdn_replay launch):
zero, copy, free, the host bank's store/load, and every non-verify forward. Conv windows are
committed at once and never pending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.cache.gdn_slots import GDNSlots
from deltaserve.ops.gdn import GDNStash, gdn_replay
from deltaserve.ops.snapshot import snapshot_copy


@dataclass
class PendingReplay:
    """Accepted verify rows not yet in the live states: request i (live slot slot_ids[i],
    also `slots` int32 [N] on the pool's device) has its first accepted[i] rows (int32 [N])
    of every layer in `stash`."""

    stash: GDNStash
    slot_ids: list[int]
    slots: torch.Tensor
    accepted: torch.Tensor


class GDNStatePool(GDNSlots):
    """Slots 1..num_slots-1 of `.recurrent` [L, S, HV, V, K] fp32 and `.conv` [L, S, W-1, D]
    on `device` (layout and allocator: GDNSlots). `conv_dtype` is the model's activation
    dtype. Slot 0 is the padding sink."""

    __slots__ = ("_pending", "n_taken", "n_settled")

    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, head_v_dim: int,
                 head_k_dim: int, conv_dim: int, conv_width: int,
                 device: torch.device | str = "cpu",
                 conv_dtype: torch.dtype = torch.float32) -> None:
        assert num_slots >= 1, "num_slots counts the padding slot 0, so it is at least 1"
        self._init_slots(num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim, conv_dim,
                         conv_width, conv_dtype, first=1, noun="slot", what="GDN state pool",
                         device=device)
        self._pending: PendingReplay | None = None
        self.n_taken = 0    # verify steps whose pending rows the next verify applied (folded)
        self.n_settled = 0  # verify steps whose pending rows got their own gdn_replay launch

    def defer_replay(self, stash: GDNStash, slot_ids: list[int], slots: torch.Tensor,
                     accepted: torch.Tensor) -> None:
        """Record that request i (live slot slot_ids[i]; `slots` int32 [>= N], `accepted` int32
        [>= N], first N used, N = len(slot_ids)) has its first accepted[i] verify rows in
        `stash`, not yet applied. Settles any earlier pending rows first."""
        self.settle()
        n = len(slot_ids)
        self._pending = PendingReplay(stash, list(slot_ids), slots[:n].clone(),
                                      accepted[:n].to(torch.int32).clone())

    def take_pending(self, slot_ids: list[int]) -> PendingReplay | None:
        """The pending rows, handed to a verify of exactly these live slots in this order (which
        then applies them); otherwise they are settled here and None is returned."""
        pending = self._pending
        if pending is not None and pending.slot_ids == list(slot_ids):
            self._pending = None
            self.n_taken += 1
            return pending
        self.settle()
        return None

    def settle(self) -> None:
        """Apply the pending verify rows to the live states (one gdn_replay launch)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.n_settled += 1
            gdn_replay(pending.stash, self.recurrent, pending.slots, pending.accepted)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def zero(self, slot: int) -> None:
        """Write the initial (all-zero) GDN state of every layer into allocated `slot`."""
        assert self.is_allocated(slot), f"zero of slot {slot}, which is not allocated"
        self.settle()
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
        self.settle()
        pools = (self.recurrent, self.conv)
        snapshot_copy(pools, [src_slot], pools, [dst_slot])

    def free(self, slot: int) -> None:
        """GDNSlots.free, after settling pending rows (the slot may be handed out again)."""
        self.settle()
        super().free(slot)
