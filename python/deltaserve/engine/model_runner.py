"""Runs one Batch through the model: input tensors, cache metadata, forward, logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.core import Batch, ForwardContext, Phase, Req
from deltaserve.engine.attention import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from deltaserve.engine.gdn_backend import GDNMetadata, PoolGDNBackend


@dataclass
class ForwardOutput:
    """logits [M, vocab] fp32 for the rows that are sampled; owners[i] is row i's request."""

    logits: torch.Tensor
    owners: list[Req]


class ModelRunner:
    """Owns the model and the device-side caches (paged KV, GDN state pool)."""

    def __init__(self, model, kv: PagedKVCache, state_pool, device: torch.device) -> None:
        self.model, self.kv, self.state_pool, self.device = model, kv, state_pool, device

    def _context(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        ids, positions, cu = [], [], [0]
        for req, n in zip(batch.reqs, batch.extend_lens):
            start = req.device_len
            ids.extend(req.all_ids[start:start + n])
            positions.extend(range(start, start + n))
            cu.append(cu[-1] + n)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        attn_meta = AttentionMetadata.build(
            [r.page_table for r in batch.reqs], [r.device_len for r in batch.reqs],
            batch.extend_lens, self.kv.page_size, dev)
        gdn_meta = GDNMetadata(
            batch.phase, torch.tensor([r.slot for r in batch.reqs], dtype=torch.int32, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev))
        ctx = ForwardContext(positions=torch.tensor(positions, dtype=torch.long, device=dev),
                             attn=PagedAttentionBackend(self.kv, attn_meta),
                             gdn=PoolGDNBackend(self.state_pool, gdn_meta))
        return input_ids, ctx

    @torch.inference_mode()
    def forward(self, batch: Batch) -> ForwardOutput:
        """Run `batch`; return logits of the rows to sample: the last row of each prefill chunk
        that completes its prompt, every row of a decode batch."""
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
        if not rows:
            return ForwardOutput(hidden.new_empty((0, 0), dtype=torch.float32), [])
        idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return ForwardOutput(self.model.compute_logits(hidden[idx]).float(), owners)
