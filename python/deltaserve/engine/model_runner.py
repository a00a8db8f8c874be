"""Runs one Batch through the model: input tensors, cache metadata, forward, logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.core import Batch, ForwardContext, Phase, Req
from deltaserve.engine.attention import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    PagedMetadata,
)
from deltaserve.engine.gdn_backend import GDNMetadata, GDNPrefill, PoolGDNBackend
from deltaserve.engine.staging import row_positions, to_device
from deltaserve.ops.gdn import GDNStash

_TORCH = {np.int32: torch.int32, np.int64: torch.int64}


@dataclass
class ForwardOutput:
    """logits [M, vocab] fp32 for the rows that are sampled; owners[i] is row i's request;
    hidden [T, hidden] (after the final norm) when a proposer asked for it, else None;
    greedy [M] int64 on the device: logits.argmax(-1), when the step computed it (graphs).
    accepted [N, k+2] int64 on the device, a verify graph's greedy acceptance of its drafts:
    per request [a, greedy of rows 0..k] (spec/accept.py's `pack_greedy`); valid only where
    the sampled tokens are greedy's."""

    logits: torch.Tensor
    owners: list[Req]
    hidden: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    accepted: torch.Tensor | None = None


class ModelRunner:
    """Owns the model and the device-side caches (paged KV, GDN state pool, verify stashes)."""

    def __init__(self, model, kv: PagedKVCache, state_pool, device: torch.device,
                 max_reqs: int, rows_per_req: int = 1,
                 draft_kv: PagedKVCache | None = None) -> None:
        self.model, self.kv, self.state_pool, self.device = model, kv, state_pool, device
        self.draft_kv = draft_kv
        # Two verify stashes: a verify writes one while the previous verify's accepted rows,
        # still pending (GDNStatePool.defer_replay), are read from the other.
        self.stashes: tuple[GDNStash, GDNStash] | None = None
        if rows_per_req > 1:
            c = model.config
            self.stashes = tuple(GDNStash.allocate(
                c.num_gdn_layers, max_reqs, rows_per_req, c.linear_num_key_heads,
                c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                device) for _ in range(2))
        self.last_gdn: PoolGDNBackend | None = None
        self.last_slot_ids: list[int] = []
        # False: every verify settles the pending rows with their own gdn_replay first (the
        # unfolded form; benchmarks/bench_spec.py --unfolded compares the two)
        self.fold_replay = True

    def take_pending(self, phase: Phase, slot_ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Before a forward of `phase` over these live slots (eager or a graph replay, once per
        forward). A verify gets (index of the stash it writes, the pending rows int32 [N] it
        applies from the other stash, or None when none are pending for exactly these requests
        in this order: those are settled). Any other phase settles pending rows: (0, None)."""
        if phase is not Phase.VERIFY or not self.fold_replay:
            self.state_pool.settle()
            return 0, None
        pending = self.state_pool.take_pending(slot_ids)
        if pending is None:
            return 0, None
        return (1 if pending.stash is self.stashes[0] else 0), pending.accepted

    def input_ids(self, batch: Batch) -> list[int]:
        """The tokens each row feeds: prompt chunks, the pending token, or pending + drafts."""
        ids = []
        drafts = batch.host_drafts() if batch.phase is Phase.VERIFY else None
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start = req.device_len
            if batch.phase is Phase.VERIFY:
                ids.extend(req.tokens(start, start + 1))
                ids.extend(drafts[i])
            else:
                ids.extend(req.tokens(start, start + n))
        return ids

    def _context(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        starts = [req.device_len for req in batch.reqs]
        positions = row_positions(starts, batch.extend_lens)
        cu = np.concatenate([[0], np.cumsum(batch.extend_lens)])
        dev = self.device
        input_ids = to_device(self.input_ids(batch), torch.long, dev)
        tables, starts = [r.page_table for r in batch.reqs], [r.device_len for r in batch.reqs]
        if batch.phase is Phase.PREFILL:
            attn_meta = AttentionMetadata.build(tables, starts, batch.extend_lens,
                                                self.kv.page_size, dev,
                                                lambda a: to_device(a, torch.int64, dev),
                                                dtype=self.kv.k.dtype)
        else:  # decode / verify: every request has rows_per_req rows; attended in place
            attn_meta = PagedMetadata.build(tables, starts, batch.rows_per_req,
                                            self.kv.page_size, dev)
        slot_ids = [r.slot for r in batch.reqs]
        if batch.phase is Phase.PREFILL:
            pre = GDNPrefill.build(batch.extend_lens, slot_ids, batch.tracks,
                                   lambda a: to_device(a, _TORCH[a.dtype.type], dev))
            gdn_meta = GDNMetadata(batch.phase, pre.slots, pre.cu_seqlens, prefill=pre)
        else:
            gdn_meta = GDNMetadata(batch.phase, to_device(slot_ids, torch.int32, dev),
                                   to_device(cu, torch.int32, dev), batch.rows_per_req)
        write, rows = self.take_pending(batch.phase, slot_ids)
        if batch.phase is Phase.VERIFY:
            gdn_meta.stash = self.stashes[write]
            if rows is not None:
                gdn_meta.pending = (self.stashes[1 - write], rows)
        self.last_gdn = PoolGDNBackend(self.state_pool, gdn_meta)
        self.last_slot_ids = slot_ids
        ctx = ForwardContext(positions=to_device(positions, torch.long, dev),
                             attn=PagedAttentionBackend(self.kv, attn_meta), gdn=self.last_gdn)
        return input_ids, ctx

    @torch.inference_mode()
    def forward(self, batch: Batch, keep_hidden: bool = False) -> ForwardOutput:
        """Run `batch`; return logits of the rows to sample: the last row of each prefill chunk
        that completes its prompt, every row of a decode or verify batch."""
        input_ids, ctx = self._context(batch)
        hidden = self.model.forward(input_ids, ctx)
        rows, owners, end = [], [], 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            end += n
            if batch.phase is Phase.PREFILL:
                if req.device_len + n == req.prompt_len:
                    rows.append(end - 1)
                    owners.append(req)
            else:
                rows.extend(range(end - n, end))
                owners.extend([req] * n)
        kept = hidden if keep_hidden else None
        if not rows:
            return ForwardOutput(hidden.new_empty((0, 0), dtype=torch.float32), [], kept)
        idx = to_device(rows, torch.long, hidden.device)
        return ForwardOutput(self.model.compute_logits(hidden[idx]).float(), owners, kept)

    @torch.inference_mode()
    def commit_verify(self, committed: list[int]) -> None:
        """After a verify forward: commit committed[i] rows of request i (conv windows now,
        GDN rows pending until the next verify or the next access to the state pool)."""
        pad = self.last_gdn.meta.slots.shape[0] - len(committed)  # a graph's padding requests
        accepted = to_device(committed + [0] * pad, torch.int32, self.device)
        self.last_gdn.commit(accepted, self.last_slot_ids)
