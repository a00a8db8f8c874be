"""Paged KV storage for the full-attention layers and the attention backend over it.

Decode and verify steps (`PagedMetadata`) append their rows with `ops.kv_append` and attend
in place with `ops.paged_attention`: the CUDA kernel reads page tables and lengths from device
tensors (one CUDA graph per batch size serves every context length); elsewhere the ops'
pure-torch references run. Prefill chunks (`AttentionMetadata`) write their rows into their
pages and attend through SDPA's fused kernels (engine/prefill_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.engine.prefill_attention import AttentionMetadata, prefill_attention
from deltaserve.engine.staging import copy_into, staged
from deltaserve.ops.attention import kv_append, paged_attention


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


@dataclass
class PagedMetadata:
    """Decode / verify metadata that the kernels read on the device, shared by every layer.

    page_table [N, M] int32: request i's pages (columns past its pages: 0, the padding page).
    kv_lens [N] int32: positions of request i after this step's rows (device_len + rows).
    rows: rows per request (1 decode, k+1 verify); row r of request i is flat row i * rows + r.
    max_kv_len: a host bound on kv_lens (sizes the kernel's split grid; a graph: max_model_len).
    Padding requests (a graph's batch bucket) have a zero table row and kv_lens = rows.
    """

    page_table: torch.Tensor
    kv_lens: torch.Tensor
    rows: int
    max_kv_len: int
    # fill's host copy of page_table (numpy int32) and each row's pages as last written
    _host: np.ndarray | None = field(default=None, repr=False, compare=False)
    _rows: list[list[int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def allocate(cls, num_reqs: int, rows: int, max_kv_len: int, page_size: int,
                 device: torch.device) -> PagedMetadata:
        """Static buffers for a graph of `num_reqs` requests: all padding until `fill`."""
        max_pages = -(-max_kv_len // page_size)
        table = torch.zeros((num_reqs, max_pages), dtype=torch.int32, device=device)
        lens = torch.full((num_reqs,), rows, dtype=torch.int32, device=device)
        return cls(table, lens, rows, max_kv_len)

    @classmethod
    def build(cls, page_tables: list[list[int]], starts: list[int], rows: int,
              page_size: int, device: torch.device) -> PagedMetadata:
        """Eager metadata for len(starts) requests whose rows start at `starts`."""
        max_kv_len = max(starts) + rows
        meta = cls.allocate(len(starts), rows, max_kv_len, page_size, torch.device("cpu"))
        meta.fill(page_tables, starts, page_size)
        return cls(meta.page_table.to(device), meta.kv_lens.to(device), rows, max_kv_len)

    def fill(self, page_tables: list[list[int]], starts: list[int], page_size: int,
             lengths: bool = True) -> None:
        """Point the first len(starts) requests at these pages and lengths; the rest become
        padding (`lengths=False`: the table only, for a graph that computes its lengths).
        Only the columns this batch needs are written: a column past a request's length is
        never read by the kernel, and the reference masks it (any page id < P).

        A graph's buffers are filled every step with nearly the same tables (a decode request
        gains a page every page_size steps), so a host copy of the table is kept and only rows
        whose pages differ from the last fill are rewritten; the table is copied to the
        device only when one did (a list comparison per row: building every row again cost
        72 µs at batch 32, bench_step_host.py)."""
        n, rows = len(starts), self.rows
        if max(starts, default=0) + rows > self.max_kv_len:
            raise ValueError(f"a request reaches {max(starts) + rows} positions, past this "
                             f"step's max_kv_len {self.max_kv_len}")
        cols = -(-(max(starts, default=0) + rows) // page_size)
        if self._rows is None:  # numpy rows: 5x faster than torch per-row writes (bench_host.py)
            self._host = np.zeros(tuple(self.page_table.shape), dtype=np.int32)
            self._rows = [[] for _ in range(self._host.shape[0])]
        changed = False
        for i, old in enumerate(self._rows):
            got = page_tables[i][:cols] if i < n else []
            if got != old:
                self._host[i, :len(old)] = 0
                self._host[i, :len(got)] = got
                self._rows[i] = got
                changed = True
        # through pinned memory like every other step input (engine/staging.py): a
        # non-blocking copy from pageable numpy memory would still stage synchronously
        if changed:
            self.page_table[:, :cols].copy_(
                staged(self._host[:, :cols], torch.int32, self.page_table.device),
                non_blocking=self.page_table.is_cuda)
        if lengths:
            lens = np.full(self.kv_lens.shape[0], rows, dtype=np.int32)
            lens[:n] += np.asarray(starts, dtype=np.int32)
            copy_into(self.kv_lens, lens)


class PagedAttentionBackend:
    """AttentionBackend over a PagedKVCache for one forward (see core.AttentionBackend):
    in place for decode / verify (`PagedMetadata`), SDPA for prefill (`AttentionMetadata`)."""

    def __init__(self, kv: PagedKVCache, meta: AttentionMetadata | PagedMetadata) -> None:
        self.kv, self.meta = kv, meta

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        li = self.kv.layer_index[layer_id]
        if isinstance(self.meta, PagedMetadata):
            return self._paged(li, q, k, v)
        return prefill_attention(self.meta, self.kv.k[li], self.kv.v[li], q, k, v)

    def _paged(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N * R, Hq, D], k/v [N * R, Hkv, D] -> [N * R, Hq, D]; softmax scale D^-1/2 (the
        model's `scaling`, and what SDPA's default gave the gather path)."""
        meta, kc, vc = self.meta, self.kv.k[li], self.kv.v[li]
        kv_append(k, v, kc, vc, meta.page_table, meta.kv_lens)
        t, hq, d = q.shape
        out = paged_attention(q.reshape(t // meta.rows, meta.rows, hq, d).to(kc.dtype), kc, vc,
                              meta.page_table, meta.kv_lens, d ** -0.5, meta.max_kv_len)
        return out.view(t, hq, d).to(q.dtype)
