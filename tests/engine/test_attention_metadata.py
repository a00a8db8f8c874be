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


def assert_reads_the_definition(meta, tables, starts, page_size):
    """meta's lengths are the definition's, and so are the table entries each request may
    read (padding: page 0); later columns may hold an earlier fill's pages, never read, valid
    page ids either way."""
    num_reqs, max_pages = meta.page_table.shape
    lens, used = reference_paged(tables, starts, meta.rows, page_size, num_reqs, max_pages)
    assert torch.equal(meta.kv_lens, lens)
    for i in range(num_reqs):
        pages = -(-int(lens[i]) // page_size)
        assert torch.equal(meta.page_table[i, :pages], used[i, :pages])


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
            assert_reads_the_definition(meta, tables, starts, page_size)


def test_fill_refuses_a_request_past_max_kv_len():
    meta = PagedMetadata.allocate(2, 1, 32, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="max_kv_len 32"):
        meta.fill([[1, 2, 3]], [32], 16)


def test_refills_with_tables_changed_in_place_match_the_definition():
    """A graph's buffers are refilled every step with the same page-table lists, mutated in
    place as the scheduler does: a page appended, tail pages freed and replaced by others at
    the same length (a verify's rollback, then the next step's pages), requests leaving and
    joining. fill rewrites only rows that changed since its last call; every step must still
    read exactly the definition's pages."""
    rng = random.Random(1)
    for page_size in (1, 2, 16):
        rows, max_kv_len, num_reqs = rng.randint(1, 4), 96, 5
        meta = PagedMetadata.allocate(num_reqs, rows, max_kv_len, page_size, torch.device("cpu"))
        free = list(range(1, 2000))
        rng.shuffle(free)
        live: list[tuple[list[int], int]] = []  # (page table, start) per request, in order
        for _ in range(200):
            op = rng.random()
            if op < 0.15 and len(live) < num_reqs:  # a request joins (anywhere in the batch)
                start = rng.randint(0, max_kv_len // 2)
                live.insert(rng.randint(0, len(live)), ([], start))
            elif op < 0.25 and live:  # a request leaves; its pages go back to the pool
                free.extend(live.pop(rng.randrange(len(live)))[0])
            elif op < 0.45 and live:  # rollback: tail pages replaced, same count
                table, start = live[rng.randrange(len(live))]
                cut = rng.randint(0, len(table))
                tail = table[cut:]
                rng.shuffle(tail)
                free.extend(tail)  # taken again first, maybe in another order
                del table[cut:]
            # every request advances and owns the pages its rows reach
            live = [(t, min(s + rng.randint(0, rows), max_kv_len - rows)) for t, s in live]
            for table, start in live:
                while len(table) < -(-(start + rows) // page_size):
                    table.append(free.pop())
            tables, starts = [t for t, _ in live], [s for _, s in live]
            meta.fill(tables, starts, page_size)
            assert_reads_the_definition(meta, tables, starts, page_size)
