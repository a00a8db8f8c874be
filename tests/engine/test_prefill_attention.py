"""Prefill attention, both paths (one request at a time, padded), against the dense causal
definition: each request's new rows go to their pages and see its positions up to their own."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.engine.prefill_attention import AttentionMetadata, prefill_attention


def case(starts, lens, page_size, hq=4, hkv=2, d=8, seed=0):
    """Random cache with each request's cached positions filled, its page table, new rows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 + sum(-(-(s + n) // page_size) for s, n in zip(starts, lens))
    free = list(range(1, num_pages))
    rng.shuffle(free)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    tables = [[free.pop() for _ in range(-(-(s + n) // page_size))] for s, n in zip(starts, lens)]
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    return k_cache, v_cache, tables, q, k, v


def dense(k_cache, v_cache, tables, starts, lens, q, k, v):
    """Per request: positions 0..start+rows-1 from the pages (new rows from k/v), causal."""
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    outs, row = [], 0
    for table, start, rows in zip(tables, starts, lens):
        keys = [k_cache[table[p // page_size], p % page_size] for p in range(start)]
        vals = [v_cache[table[p // page_size], p % page_size] for p in range(start)]
        keys = torch.stack(keys + list(k[row:row + rows])).double()  # [L, Hkv, D]
        vals = torch.stack(vals + list(v[row:row + rows])).double()
        qi = q[row:row + rows].double()
        g = qi.shape[1] // hkv
        scores = torch.einsum("rhd,lhd->hrl", qi, keys.repeat_interleave(g, 1))
        scores = scores / qi.shape[-1] ** 0.5
        pos = torch.arange(start + rows)
        seen = pos[None, :] <= (start + torch.arange(rows))[:, None]
        scores = scores.masked_fill(~seen[None], float("-inf"))
        outs.append(torch.einsum("hrl,lhd->rhd", scores.softmax(-1),
                                 vals.repeat_interleave(g, 1)))
        row += rows
    return torch.cat(outs)


# the keyword arguments of AttentionMetadata.build that force each path
PATHS = {"per_request": {"per_request": True}, "padded": {"per_request": False, "varlen": False},
         "varlen": {"varlen": True}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("starts", "lens", "page_size"), [
    ([0], [37], 16),
    ([0, 64, 5], [20, 64, 1], 16),
    ([130, 0, 0, 7], [3, 9, 70, 50], 1),
    ([64, 0], [64, 128], 64),
])
def test_every_path_matches_the_dense_causal_definition(path, starts, lens, page_size):
    """On the CPU the varlen path attends its packed gather one request at a time: this checks
    its metadata (index, bounds) and fallback; the flash call itself is a gpu test."""
    k_cache, v_cache, tables, q, k, v = case(starts, lens, page_size)
    want = dense(k_cache, v_cache, tables, starts, lens, q, k, v)
    meta = AttentionMetadata.build(tables, starts, lens, page_size, torch.device("cpu"),
                                   **PATHS[path])
    assert (meta.varlen, meta.per_request) == (path == "varlen", path == "per_request")
    got = prefill_attention(meta, k_cache, v_cache, q, k, v)
    assert got.is_contiguous() and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # the new rows are in their pages
    for table, start, rows, r0 in zip(tables, starts, lens, [0, *torch.tensor(lens).cumsum(0)]):
        for j in range(rows):
            p = start + j
            assert torch.equal(k_cache[table[p // page_size], p % page_size], k[int(r0) + j])


def test_build_uploads_once_and_picks_the_path_by_device_and_request_count():
    calls = []

    def upload(arr):
        calls.append(arr)
        return torch.from_numpy(arr)

    tables, starts, lens = [[1, 2], [3]], [10, 0], [5, 4]
    meta = AttentionMetadata.build(tables, starts, lens, 16, torch.device("cpu"), upload)
    assert len(calls) == 1 and not meta.per_request  # CPU: the padded reference path
    assert meta.write_index.tolist() == [26, 27, 28, 29, 30, 48, 49, 50, 51]
    assert meta.row_index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    meta = AttentionMetadata.build(tables, starts, lens, 16, torch.device("cpu"), upload,
                                   per_request=True)
    assert len(calls) == 2 and meta.contexts[1] is None
    assert meta.contexts[0].tolist() == list(range(16, 31))
    meta = AttentionMetadata.build(tables, starts, lens, 16, torch.device("cpu"), upload,
                                   varlen=True)
    assert len(calls) == 3 and meta.varlen and not meta.per_request
    assert meta.kv_index.tolist() == [*range(16, 31), *range(48, 52)]  # 15 + 4 positions
    assert meta.kv_bounds == (0, 15, 19) and meta.cu_k.tolist() == [0, 15, 19]
    assert meta.cu_q.tolist() == [0, 5, 9] and meta.cu_q.dtype == torch.int32
    assert (meta.max_q, meta.max_k) == (5, 15)


def test_cuda_attends_one_request_at_a_time_when_few_or_when_padding_would_blow_up():
    from deltaserve.engine.prefill_attention import PADDED_MAX, PER_REQUEST_MAX

    def path(lens, starts=None):
        starts = starts or [0] * len(lens)
        tables = [list(range(1, 2 + (s + n) // 16)) for s, n in zip(starts, lens)]
        return AttentionMetadata.build(tables, starts, lens, 16, torch.device("cuda"),
                                       upload=torch.from_numpy).per_request

    assert path([64] * PER_REQUEST_MAX)
    assert not path([64] * (PER_REQUEST_MAX + 1))
    n = PER_REQUEST_MAX + 1  # one 8k chunk among short ones: N x 8k x 8k would be padded
    assert 8192 * 8192 * n > PADDED_MAX and path([8192] + [5] * (n - 1))
    assert not path([64] * n, starts=[0] * n)


@pytest.mark.parametrize("flash", [True, False])
def test_cuda_takes_varlen_past_the_per_request_limit_for_16_bit_kv_where_flash_runs(
        monkeypatch, flash):
    from deltaserve.engine import prefill_attention as pa

    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: flash)

    def path(n, dtype):
        meta = AttentionMetadata.build([[1, 2]] * n, [0] * n, [20] * n, 16, torch.device("cuda"),
                                       upload=torch.from_numpy, dtype=dtype)
        return "varlen" if meta.varlen else "per_request" if meta.per_request else "padded"

    many = pa.PER_REQUEST_MAX + 1
    assert path(pa.PER_REQUEST_MAX, torch.bfloat16) == "per_request"
    for dtype in (torch.bfloat16, torch.float16):
        assert path(many, dtype) == ("varlen" if flash else "padded")
    assert path(many, torch.float32) == path(many, None) == "padded"
    # a failed flash call turns the path off for the process
    monkeypatch.setattr(pa, "_varlen_failed", ["no kernel"])
    assert path(many, torch.bfloat16) == "padded"
