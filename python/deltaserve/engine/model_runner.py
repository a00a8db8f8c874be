"""Runs one Batch through the model: input tensors, cache metadata, forward, logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.core import Batch, ForwardContext, Phase, Req
from deltaserve.engine.attention import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from deltaserve.engine.gdn_backend import GDNMetadata, PoolGDNBackend
from deltaserve.ops.gdn import GDNStash


@dataclass
class ForwardOutput:
    """logits [M, vocab] fp32 for the rows that are sampled; owners[i] is row i's request;
    hidden [T, hidden] (after the final norm) when a proposer asked for it, else None."""

    logits: torch.Tensor
    owners: list[Req]
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Owns the model and the device-side caches (paged KV, GDN state pool, verify stash)."""

    def __init__(self, model, kv: PagedKVCache, state_pool, device: torch.device,
                 max_reqs: int, rows_per_req: int = 1,
                 draft_kv: PagedKVCache | None = None) -> None:
        self.model, self.kv, self.state_pool, self.device = model, kv, state_pool, device
        self.draft_kv = draft_kv
        self.stash = None
        if rows_per_req > 1:
            c = model.config
            self.stash = GDNStash.allocate(
                c.num_gdn_layers, max_reqs, rows_per_req, c.linear_num_key_heads,
                c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                device)
        self.last_gdn: PoolGDNBackend | None = None

    def input_ids(self, batch: Batch) -> list[int]:
        """The tokens each row feeds: prompt chunks, the pending token, or pending + drafts."""
        ids = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start = req.device_len
            if batch.phase is Phase.VERIFY:
                ids.extend(req.tokens(start, start + 1))
                ids.extend(batch.draft_ids[i])
            else:
                ids.extend(req.tokens(start, start + n))
        return ids

    def _context(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        positions, cu = [], [0]
        for req, n in zip(batch.reqs, batch.extend_lens):
            positions.extend(range(req.device_len, req.device_len + n))
            cu.append(cu[-1] + n)
        dev = self.device
        input_ids = torch.tensor(self.input_ids(batch), dtype=torch.long, device=dev)
        attn_meta = AttentionMetadata.build(
            [r.page_table for r in batch.reqs], [r.device_len for r in batch.reqs],
            batch.extend_lens, self.kv.page_size, dev)
        gdn_meta = GDNMetadata(
            batch.phase, torch.tensor([r.slot for r in batch.reqs], dtype=torch.int32, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev), batch.rows_per_req, self.stash)
        self.last_gdn = PoolGDNBackend(self.state_pool, gdn_meta)
        ctx = ForwardContext(positions=torch.tensor(positions, dtype=torch.long, device=dev),
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
        idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return ForwardOutput(self.model.compute_logits(hidden[idx]).float(), owners, kept)

    @torch.inference_mode()
    def commit_verify(self, committed: list[int]) -> None:
        """After a verify forward: apply committed[i] rows of request i to its GDN state."""
        pad = self.last_gdn.meta.slots.shape[0] - len(committed)  # a graph's padding requests
        accepted = torch.tensor(committed + [0] * pad, dtype=torch.int32, device=self.device)
        self.last_gdn.commit(accepted)
