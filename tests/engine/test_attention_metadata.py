"""PagedMetadata (decode / verify steps, CUDA graphs' static buffers) against its definition,
request by request, including refills that shrink the batch and its lengths."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.engine.attention import PagedMetadata


def reference_paged(page_tables, starts, rows, page_size, num_reqs, max_pages):
    """The definition: request i reads its table's pages for positions [0, start + rows) and
    has kv_len start + rows; padding requests (after the real ones) have kv_len = rows on a
    zero table row. Returns (kv_lens, the table entries each request may read)."""
    lens = torch.full((num_reqs,), rows, dtype=torch.int32)
    used = torch.zeros((num_reqs, max_pages), dtype=torch.int32)
    for i, (table, start) in enumerate(zip(page_tables, starts)):
        lens[i] = start + rows
        pages = -(-(start + rows) // page_size)
        used[i, :pages] = torch.tensor(table[:pages], dtype=torch.int32)
    return lens, used


def test_fill_matches_the_definition_for_random_batches():
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        rows, max_kv_len, num_reqs = rng.randint(1, 5), 64, rng.randint(1, 6)
        meta = PagedMetadata.allocate(num_reqs, rows, max_kv_len, page_size, torch.device("cpu"))
        for _ in range(30):  # refills of one set of static buffers
            n = rng.randint(0, num_reqs)
            starts = [rng.randint(0, max_kv_len - rows) for _ in range(n)]
            tables = [rng.sample(range(1, 500), -(-(s + rows) // page_size) + rng.randint(0, 3))
                      for s in starts]
            meta.fill(tables, starts, page_size)
            lens, used = reference_paged(tables, starts, rows, page_size, num_reqs,
                                         meta.page_table.shape[1])
            assert torch.equal(meta.kv_lens, lens)
            # the entries a request may read are its pages (padding: page 0); later columns
            # may hold an earlier fill's pages, never read, valid page ids either way
            for i in range(num_reqs):
                pages = -(-int(lens[i]) // page_size)
                assert torch.equal(meta.page_table[i, :pages], used[i, :pages])


def test_fill_refuses_a_request_past_max_kv_len():
    meta = PagedMetadata.allocate(2, 1, 32, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="max_kv_len 32"):
        meta.fill([[1, 2, 3]], [32], 16)
