"""AttentionMetadata.build_padded (CUDA graph steps) against its definition, request by request."""

from __future__ import annotations

import random

import torch

from deltaserve.engine.attention import AttentionMetadata


def reference_padded(page_tables, starts, rows, page_size, num_reqs, kv_len):
    """The definition, one request at a time: positions [0, start + rows) map through the page
    table; new rows write [start, start + rows); row r sees positions <= start + r; padding
    requests (after the real ones) write page 0 and see only position 0."""
    gather = torch.zeros((num_reqs, kv_len), dtype=torch.long)
    write = torch.zeros((num_reqs, rows), dtype=torch.long)
    mask = torch.zeros((num_reqs, 1, rows, kv_len), dtype=torch.bool)
    mask[len(starts):, 0, :, 0] = True
    for i, (table, start) in enumerate(zip(page_tables, starts)):
        for p in range(start + rows):
            gather[i, p] = table[p // page_size] * page_size + p % page_size
        for r in range(rows):
            write[i, r] = gather[i, start + r]
            mask[i, 0, r, :start + r + 1] = True
    return write.view(-1), gather, mask


def test_build_padded_matches_the_definition_for_random_batches():
    rng = random.Random(0)
    for _ in range(100):
        page_size = rng.choice([1, 4, 16])
        rows, kv_len = rng.randint(1, 5), rng.choice([16, 40, 64])
        num_reqs = rng.randint(1, 6)
        n = rng.randint(0, num_reqs)
        starts = [rng.randint(0, kv_len - rows) for _ in range(n)]
        # a table may hold more pages than kv_len needs (a later bucket) or exactly enough
        tables = [rng.sample(range(1, 500), -(-(s + rows) // page_size) + rng.randint(0, 3))
                  for s in starts]
        meta = AttentionMetadata.build_padded(tables, starts, rows, page_size, num_reqs, kv_len)
        write, gather, mask = reference_padded(tables, starts, rows, page_size, num_reqs, kv_len)
        assert torch.equal(meta.write_index, write)
        assert torch.equal(meta.gather_index, gather)
        assert torch.equal(meta.mask, mask)
        assert torch.equal(meta.row_index, torch.arange(num_reqs * rows).view(num_reqs, rows))
