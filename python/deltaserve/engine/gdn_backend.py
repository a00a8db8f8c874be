"""GDN backend: runs a GDN layer's conv1d + gated delta rule against the state pool's slots.

Prefill rows go through the varlen conv and the chunked rule (initial state from each request's
live slot, final state written back), with every index built once per forward (`GDNPrefill`):
no layer reads anything back from the device. A request whose chunk passes a track depth
(Batch.tracks) is split there into two chained sequences: its conv window and recurrent state
at that depth go to the track slot in the same forward. Decode rows through the one-row conv
update and `gdn_decode`, both updating the slot in place. Verify rows (k+1 per request) read
the slot only: `causal_conv1d_verify` and `gdn_verify`, which stashes each row's recurrence
inputs; the conv inputs are kept in `conv_inputs`. `commit` then writes the accepted rows' conv
windows and leaves their GDN rows pending in the pool (GDNStatePool.defer_replay): the next
verify of the same requests applies them in its own launch (`meta.pending`);
ModelRunner.take_pending settles them before any other forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.cache.state_pool import GDNStatePool
from deltaserve.core import Phase
from deltaserve.ops import conv1d, gdn
from deltaserve.ops.chunk_prefill import PrefillIndex, gdn_chunk_prefill

Upload = Callable[[np.ndarray], torch.Tensor]  # host array -> device tensor, same dtype


@dataclass(frozen=True)
class GDNPrefill:
    """A prefill forward's GDN indices, shared by every GDN layer (device tensors).

    cu_seqlens int32 [N+1] and slots int32 [N]: the requests (the conv runs one sequence per
    request); track_offsets / track_slots int32 [N] or None: request i's conv window after
    track_offsets[i] of its rows also goes to slot track_slots[i] (0: none); index: the
    recurrence's sequences (a tracked request is two chained ones, split at its offset);
    src int64 [M]: the slot each sequence's initial state is read from (its request's live
    slot); dest int64 [M]: where its final state goes (the track slot for the first half of a
    split, else the live slot).
    """

    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    track_offsets: torch.Tensor | None
    track_slots: torch.Tensor | None
    index: PrefillIndex
    src: torch.Tensor
    dest: torch.Tensor

    @classmethod
    def build(cls, lens: Sequence[int], slots: Sequence[int],
              tracks: Sequence[tuple[int, int] | None] | None, upload: Upload) -> GDNPrefill:
        """lens[i] rows of request i (live slot slots[i]); tracks[i] = (offset, track slot)
        with 0 < offset < lens[i], or None. Three host->device copies in all."""
        n = len(lens)
        tracks = list(tracks) if tracks is not None else [None] * n
        bounds, chained, src, dest, row = [0], [], [], [], 0
        for rows, slot, track in zip(lens, slots, tracks):
            if track is not None:
                off, tslot = track
                if not 0 < off < rows:
                    raise ValueError(f"a track offset must lie inside its chunk (0 < {off} < "
                                     f"{rows})")
                bounds.append(row + off)
                chained.append(False)
                src.append(slot)
                dest.append(tslot)
            row += rows
            bounds.append(row)
            chained.append(track is not None)
            src.append(slot)
            dest.append(slot)
        has_tracks = any(t is not None for t in tracks)
        i32 = [np.concatenate([[0], np.cumsum(lens)]), slots]
        if has_tracks:
            i32 += [[t[0] if t else 0 for t in tracks], [t[1] if t else 0 for t in tracks]]
        flat = upload(np.concatenate([np.asarray(x, dtype=np.int32) for x in i32]))
        parts = flat.split([n + 1, n] + ([n, n] if has_tracks else []))
        slots64 = upload(np.asarray(src + dest, dtype=np.int64))
        m = len(src)
        return cls(parts[0], parts[1], parts[2] if has_tracks else None,
                   parts[3] if has_tracks else None,
                   PrefillIndex.build(bounds, chained, upload=upload), slots64[:m], slots64[m:])


@dataclass
class GDNMetadata:
    """phase; slots [N] int32 (live slot per request); cu_seqlens [N+1] int32 (prefill rows);
    rows_per_req and stash (verify); pending (verify): (previous stash, rows int32 [N]), the
    previous verify's accepted rows of these requests, applied before this verify; prefill
    (prefill): the forward's indices."""

    phase: Phase
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    rows_per_req: int = 1
    stash: gdn.GDNStash | None = None
    pending: tuple[gdn.GDNStash, torch.Tensor] | None = None
    prefill: GDNPrefill | None = None


class PoolGDNBackend:
    """GDNBackend over a GDNStatePool for one forward (see core.GDNBackend)."""

    def __init__(self, pool: GDNStatePool, meta: GDNMetadata) -> None:
        self.pool, self.meta = pool, meta
        self.conv_inputs: dict[int, torch.Tensor] = {}  # gdn_id -> verify inputs [N, R, D]

    def forward(self, layer, mixed_qkv: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        meta, gid = self.meta, layer.gdn_id
        if meta.phase is Phase.PREFILL:
            return self._prefill(layer, mixed_qkv, a, b)
        conv_state = self.pool.conv[gid]
        state = self.pool.recurrent[gid]
        bias = getattr(layer, "conv_bias", None)
        n_rows = meta.rows_per_req
        if meta.phase is Phase.VERIFY:
            x = mixed_qkv.view(-1, n_rows, mixed_qkv.shape[-1])
            self.conv_inputs[gid] = x
            y = conv1d.causal_conv1d_verify(x, layer.conv_weight, bias, conv_state,
                                            meta.slots).view(-1, x.shape[-1])
        else:
            y = conv1d.causal_conv1d_update(mixed_qkv, layer.conv_weight, bias, conv_state,
                                            meta.slots)
        h, hv = layer.num_k_heads, layer.num_v_heads
        dk, dv = layer.head_k_dim, layer.head_v_dim
        q, k, v = torch.split(y, [h * dk, h * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(-1, h, dk), k.reshape(-1, h, dk), v.reshape(-1, hv, dv)
        scale = dk ** -0.5
        if meta.phase is Phase.VERIFY:
            n = meta.slots.shape[0]
            o = gdn.gdn_verify(q.reshape(n, n_rows, h, dk), k.reshape(n, n_rows, h, dk),
                               v.reshape(n, n_rows, hv, dv), a.reshape(n, n_rows, hv),
                               b.reshape(n, n_rows, hv), layer.A_log, layer.dt_bias, state,
                               meta.slots, scale, meta.stash, gid, pending=meta.pending)
            return o.reshape(-1, hv, dv)
        return gdn.gdn_decode(q, k, v, a, b, layer.A_log, layer.dt_bias, state, meta.slots,
                              scale)

    def _prefill(self, layer, mixed_qkv: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor) -> torch.Tensor:
        pre, gid = self.meta.prefill, layer.gdn_id
        conv_state, state = self.pool.conv[gid], self.pool.recurrent[gid]
        dk = layer.head_k_dim
        q, k, v = conv1d.conv_qkv_prefill(
            mixed_qkv, layer.conv_weight, getattr(layer, "conv_bias", None), conv_state,
            pre.cu_seqlens, pre.slots, pre.track_offsets, pre.track_slots,
            num_k_heads=layer.num_k_heads, head_k_dim=dk)
        o, final = gdn_chunk_prefill(q, k, v.view(-1, layer.num_v_heads, layer.head_v_dim), a,
                                     b, layer.A_log, layer.dt_bias,
                                     state.index_select(0, pre.src), pre.index, dk ** -0.5,
                                     qk_normalized=True)
        state.index_copy_(0, pre.dest, final)
        return o

    def commit(self, accepted: torch.Tensor, slot_ids: list[int]) -> None:
        """After this verify: the first accepted[i] rows (int32 [>= N], 0..R) of request i
        (live slot slot_ids[i]) are committed: conv windows written now, GDN rows left pending
        in the pool (settled before anything else reads the state). Together bitwise what that
        many decode steps give."""
        for gid, x in self.conv_inputs.items():
            conv1d.causal_conv1d_commit(x, self.pool.conv[gid], self.meta.slots, accepted)
        self.pool.defer_replay(self.meta.stash, slot_ids, self.meta.slots, accepted)
