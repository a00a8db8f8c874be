"""Paged KV storage for the full-attention layers and the torch attention backend over it.

The backend writes each new row's k/v into its page, gathers every request's cached positions
plus its new rows into a padded [N, L, Hkv, D] block and runs `scaled_dot_product_attention`
with a causal mask per request (position j is visible to a row at position p iff j <= p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PagedKVCache:
    """KV pages of all full-attention layers: k/v [layers, num_pages, page_size, Hkv, D].

    `layer_index` maps a model layer id (the id the attention layer passes to the backend) to
    its row in the tensors. Page 0 is a padding sink (PagePool never hands it out).
    """

    def __init__(self, layer_ids: list[int], num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layer_index = {lid: i for i, lid in enumerate(layer_ids)}
        shape = (len(layer_ids), num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem


@dataclass
class AttentionMetadata:
    """Per-forward indices, built once and shared by every attention layer.

    write_index [T]: flat KV index (page * page_size + offset) of each new row.
    gather_index [N, L]: flat KV index of each request's positions 0..L-1 (padding -> 0).
    row_index [N, Rmax]: flat row (into the batch's T rows) of each request's new rows
        (padding -> T, a dummy row).
    mask [N, 1, Rmax, L] bool: True where a row may attend a position.
    """

    write_index: torch.Tensor
    gather_index: torch.Tensor
    row_index: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, page_tables: list[list[int]], starts: list[int], lens: list[int],
              page_size: int, device: torch.device) -> AttentionMetadata:
        """page_tables[i] covers positions [0, starts[i] + lens[i]) of request i."""
        n = len(starts)
        total_rows = sum(lens)
        max_rows, max_kv = max(lens), max(s + r for s, r in zip(starts, lens))
        write, gather = [], torch.zeros((n, max_kv), dtype=torch.long)
        row_index = torch.full((n, max_rows), total_rows, dtype=torch.long)
        mask = torch.zeros((n, 1, max_rows, max_kv), dtype=torch.bool)
        row = 0
        for i, (table, start, rows) in enumerate(zip(page_tables, starts, lens)):
            kv_len = start + rows
            pages = torch.tensor(table, dtype=torch.long)
            pos = torch.arange(kv_len)
            flat = pages[pos // page_size] * page_size + pos % page_size
            gather[i, :kv_len] = flat
            write.append(flat[start:])
            row_index[i, :rows] = torch.arange(row, row + rows)
            q_pos = torch.arange(start, kv_len)
            mask[i, 0, :rows, :kv_len] = pos[None, :] <= q_pos[:, None]
            row += rows
        return cls(torch.cat(write).to(device), gather.to(device), row_index.to(device),
                   mask.to(device))

    @classmethod
    def build_padded(cls, page_tables: list[list[int]], starts: list[int], rows: int,
                     page_size: int, num_reqs: int, kv_len: int) -> AttentionMetadata:
        """Fixed-shape metadata on the host for a CUDA graph of `num_reqs` requests x `rows`
        rows over `kv_len` positions: real requests first, then padding requests whose rows
        write the padding page 0 and attend only position 0 (no fully masked row: no NaN).
        Row r of request i is flat row i * rows + r."""
        n = len(starts)
        assert n <= num_reqs and all(s + rows <= kv_len for s in starts)
        gather = torch.zeros((num_reqs, kv_len), dtype=torch.long)
        write = torch.zeros((num_reqs, rows), dtype=torch.long)
        mask = torch.zeros((num_reqs, 1, rows, kv_len), dtype=torch.bool)
        mask[n:, 0, :, 0] = True
        if n:  # one set of batched ops for all requests: this runs on the host every step
            n_pages = -(-kv_len // page_size)
            table = torch.tensor([t[:n_pages] + [0] * (n_pages - len(t[:n_pages]))
                                  for t in page_tables[:n]], dtype=torch.long)
            pos = torch.arange(kv_len)
            flat = table[:, pos // page_size] * page_size + pos % page_size  # [n, kv_len]
            q_pos = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(rows)
            gather[:n] = flat.masked_fill(pos[None, :] > q_pos[:, -1:], 0)
            write[:n] = flat.gather(1, q_pos)
            mask[:n, 0] = pos[None, None, :] <= q_pos[:, :, None]
        row_index = torch.arange(num_reqs * rows).view(num_reqs, rows)
        return cls(write.view(-1), gather, row_index, mask)

    def copy_(self, other: AttentionMetadata) -> None:
        """Overwrite these (static, same-shape) tensors with `other`'s values."""
        for name in ("write_index", "gather_index", "row_index", "mask"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


class PagedAttentionBackend:
    """AttentionBackend over a PagedKVCache for one forward (see core.AttentionBackend)."""

    def __init__(self, kv: PagedKVCache, meta: AttentionMetadata) -> None:
        self.kv, self.meta = kv, meta

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        li = self.kv.layer_index[layer_id]
        k_flat = self.kv.k[li].view(-1, *self.kv.k.shape[-2:])
        v_flat = self.kv.v[li].view(-1, *self.kv.v.shape[-2:])
        k_flat[self.meta.write_index] = k.to(k_flat.dtype)
        v_flat[self.meta.write_index] = v.to(v_flat.dtype)
        num_rows, hq, d = q.shape
        hkv = k.shape[1]
        q_pad = torch.cat([q, q.new_zeros(1, hq, d)])[self.meta.row_index]  # [N, R, Hq, D]
        keys = k_flat[self.meta.gather_index]  # [N, L, Hkv, D]
        values = v_flat[self.meta.gather_index]
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=2)
            values = values.repeat_interleave(hq // hkv, dim=2)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype), attn_mask=self.meta.mask)  # [N, Hq, R, D]
        out = out.transpose(1, 2)
        flat = q.new_empty(num_rows + 1, hq, d)
        flat[self.meta.row_index] = out
        return flat[:num_rows]
