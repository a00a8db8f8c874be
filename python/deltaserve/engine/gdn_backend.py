"""GDN backend: runs a GDN layer's conv1d + gated delta rule against the state pool's slots.

Prefill rows go through the varlen conv and the chunked rule (initial state from each request's
live slot, final state written back); decode rows through the one-row conv update and
`gdn_decode`, both updating the slot in place. Verify rows (k+1 per request) read the slot
only: `causal_conv1d_verify` and `gdn_verify`, which stashes each row's recurrence inputs;
the conv inputs are kept in `conv_inputs`. `commit` then writes the accepted rows' conv windows
and leaves their GDN rows pending in the pool (GDNStatePool.defer_replay): the next verify of
the same requests applies them in its own launch (`meta.pending`); ModelRunner.take_pending
settles them before any other forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.cache.state_pool import GDNStatePool
from deltaserve.core import Phase
from deltaserve.ops import conv1d, gdn


@dataclass
class GDNMetadata:
    """phase; slots [N] int32 (live slot per request); cu_seqlens [N+1] int32 (prefill rows);
    rows_per_req and stash (verify); pending (verify): (previous stash, rows int32 [N]), the
    previous verify's accepted rows of these requests, applied before this verify."""

    phase: Phase
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    rows_per_req: int = 1
    stash: gdn.GDNStash | None = None
    pending: tuple[gdn.GDNStash, torch.Tensor] | None = None


class PoolGDNBackend:
    """GDNBackend over a GDNStatePool for one forward (see core.GDNBackend)."""

    def __init__(self, pool: GDNStatePool, meta: GDNMetadata) -> None:
        self.pool, self.meta = pool, meta
        self.conv_inputs: dict[int, torch.Tensor] = {}  # gdn_id -> verify inputs [N, R, D]

    def forward(self, layer, mixed_qkv: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        meta, gid = self.meta, layer.gdn_id
        conv_state = self.pool.conv[gid]
        state = self.pool.recurrent[gid]
        bias = getattr(layer, "conv_bias", None)
        n_rows = meta.rows_per_req
        if meta.phase is Phase.PREFILL:
            y = conv1d.causal_conv1d_prefill(mixed_qkv, layer.conv_weight, bias, conv_state,
                                             meta.cu_seqlens, meta.slots)
        elif meta.phase is Phase.VERIFY:
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
        if meta.phase is Phase.PREFILL:
            g, beta = gdn.gdn_gates(a, b, layer.A_log, layer.dt_bias)
            slots = meta.slots.long()
            o, final = gdn.gdn_prefill(q, k, v, g, beta, state[slots], meta.cu_seqlens, scale)
            state[slots] = final
            return o
        if meta.phase is Phase.VERIFY:
            n = meta.slots.shape[0]
            o = gdn.gdn_verify(q.reshape(n, n_rows, h, dk), k.reshape(n, n_rows, h, dk),
                               v.reshape(n, n_rows, hv, dv), a.reshape(n, n_rows, hv),
                               b.reshape(n, n_rows, hv), layer.A_log, layer.dt_bias, state,
                               meta.slots, scale, meta.stash, gid, pending=meta.pending)
            return o.reshape(-1, hv, dv)
        return gdn.gdn_decode(q, k, v, a, b, layer.A_log, layer.dt_bias, state, meta.slots,
                              scale)

    def commit(self, accepted: torch.Tensor, slot_ids: list[int]) -> None:
        """After this verify: the first accepted[i] rows (int32 [>= N], 0..R) of request i
        (live slot slot_ids[i]) are committed: conv windows written now, GDN rows left pending
        in the pool (settled before anything else reads the state). Together bitwise what that
        many decode steps give."""
        for gid, x in self.conv_inputs.items():
            conv1d.causal_conv1d_commit(x, self.pool.conv[gid], self.meta.slots, accepted)
        self.pool.defer_replay(self.meta.stash, slot_ids, self.meta.slots, accepted)
