"""Lookahead radix keys: draft KV is reused only after the same next token (DESIGN.md, Cache)."""

from __future__ import annotations

import pytest

from deltaserve.cache.lookahead import lookahead_keys
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import GDNStatePool

SHARED = list(range(1, 9))  # 8 shared tokens, then the two requests fork
A = SHARED + list(range(20, 28))
B = SHARED + list(range(30, 38))
NEXT = 38  # the token sampled after B (the last cached position pairs with it)


def make_cache(page_size: int, lookahead: bool) -> PrefixCache:
    pages = PagePool(64, page_size)
    slots = GDNStatePool(1, 64, 1, 2, 2, 4, 4)
    return PrefixCache(pages, slots, page_size, grid=1,
                       key_fn=lookahead_keys if lookahead else None)


def cache_request(cache: PrefixCache, ids: list[int], next_token: int, lookahead: bool):
    """Insert a finished request the way the scheduler does: its own fresh pages, a snapshot at
    every page boundary, and (lookahead) the token after its last position."""
    ps = cache.page_size
    pages = cache.page_pool.allocate(len(ids) // ps)
    snaps = {}
    for depth in range(ps, len(ids) + 1, ps):
        snaps[depth] = cache.state_pool.allocate()
    res = cache.insert(ids + ([next_token] if lookahead else []), pages, snaps)
    cache.page_pool.free(res.freed_pages)
    for slot in res.unused_slots:
        cache.state_pool.free(slot)
    return pages


def test_lookahead_keys_pack_each_token_with_the_next():
    assert lookahead_keys([1, 2, 3]) == [(1 << 32) | 2, (2 << 32) | 3]
    assert lookahead_keys([5]) == []
    with pytest.raises(ValueError):
        lookahead_keys([1, 2**40])


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_query_following_the_second_fork_reuses_its_own_draft_kv(page_size):
    pos = 7  # the last shared position: its draft KV depends on t8, which differs
    got = {}
    for lookahead in (False, True):
        cache = make_cache(page_size, lookahead)
        cache_request(cache, A, 28, lookahead)
        pages_b = cache_request(cache, B, NEXT, lookahead)
        query = B[:12] + [99, 98, 97]  # follows B, then forks from it at position 12
        m = cache.match(query)
        cache.check_integrity()
        got[lookahead] = m
        owner = m.pages[pos // page_size] == pages_b[pos // page_size]
        # token keys hand back A's page for position 7 (A's draft KV: wrong after t8 = 30)
        assert owner == lookahead
    # the fork at 12: token keys hit 12; lookahead keys one position shorter (rounded to pages)
    assert got[False].cached_len == 12
    assert got[True].cached_len == (11 // page_size) * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_query_continuing_a_cached_path_hits_as_far_as_with_token_keys(page_size):
    hits = {}
    for lookahead in (False, True):
        cache = make_cache(page_size, lookahead)
        cache_request(cache, A, 28, lookahead)
        cache_request(cache, B, NEXT, lookahead)
        hits[lookahead] = cache.match(B + [NEXT, 40, 41]).cached_len
    assert hits[False] == hits[True] == len(B)


def test_a_snapshot_is_matched_only_when_the_token_after_it_agrees():
    cache = make_cache(4, True)
    cache_request(cache, B, NEXT, True)
    assert cache.match(B + [NEXT, 1]).cached_len == 16
    assert cache.match(B + [77, 1]).cached_len == 12  # t16 differs: the snapshot at 16 is out
