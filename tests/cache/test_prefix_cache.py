"""PrefixCache unit tests: match depth, forks, duplicate inserts, locks, eviction order."""

from __future__ import annotations

import pytest

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import GDNStatePool
from token_ids import random_tokens


def make_cache(page_size: int, grid: int = 64, num_tokens: int = 2048, num_slots: int = 32,
               **kwargs) -> PrefixCache:
    pages = PagePool(1 + num_tokens // page_size, page_size)
    slots = GDNStatePool(1, num_slots, 1, 1, 1, 1, 2)
    return PrefixCache(pages, slots, page_size, grid=grid, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, vocab=1000)


def put(cache: PrefixCache, ids: list[int], depths: list[int],
        pages: list[int] | None = None):
    """Insert `ids` as a finished request would: fresh pages (after `pages`, if given) and a
    fresh slot per snapshot depth. Returns (pages, {depth: slot}, InsertResult)."""
    pages = list(pages or [])
    pages += cache.page_pool.allocate(len(ids) // cache.page_size - len(pages))
    snaps = {d: cache.state_pool.allocate() for d in depths}
    result = cache.insert(ids, pages, snaps)
    cache.check_integrity()
    return pages, snaps, result


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_match_returns_the_deepest_snapshot_strictly_inside_the_prompt(page_size):
    cache = make_cache(page_size)
    ids = tokens(256, seed=1)
    pages, snaps, _ = put(cache, ids, [64, 128, 192, 256])
    for prompt_len, want in [(1, 0), (64, 0), (65, 64), (128, 64), (129, 128), (200, 192),
                             (256, 192), (257, 256), (300, 256)]:
        prompt = (ids + tokens(100, seed=2))[:prompt_len]
        m = cache.match(prompt)
        assert m.cached_len == want, prompt_len
        assert m.pages == pages[:want // page_size]
        assert m.snapshot_slot == snaps.get(want)
        assert m.node.depth == want
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_prompt_of_exactly_64n_tokens_resumes_one_grid_point_short(page_size):
    cache = make_cache(page_size)
    ids = tokens(192, seed=3)
    put(cache, ids, [64, 128, 192])
    assert cache.match(ids).cached_len == 128  # its last token is recomputed
    assert cache.match(ids[:128]).cached_len == 64


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_match_can_leave_a_one_token_tail(page_size):
    cache = make_cache(page_size)
    ids = tokens(128, seed=4)
    put(cache, ids, [128])
    m = cache.match(ids + [7])
    assert m.cached_len == 128 and len(m.pages) == 128 // page_size


def test_an_empty_cache_matches_nothing_and_returns_the_root():
    cache = make_cache(16)
    m = cache.match(tokens(100, seed=5))
    assert (m.cached_len, m.pages, m.snapshot_slot) == (0, [], None)
    assert m.node is cache.tree.root


def test_cached_pages_without_a_snapshot_are_not_matched():
    cache = make_cache(16)
    ids = tokens(256, seed=6)
    put(cache, ids, [64])
    assert cache.match(ids + [1]).cached_len == 64


def test_a_fork_on_a_page_boundary_splits_the_edge_and_keeps_both_branches():
    cache = make_cache(16)
    a = tokens(128, seed=7)
    b = a[:64] + tokens(64, seed=8)
    a_pages, a_snaps, _ = put(cache, a, [64, 128])
    m = cache.match(b + [1])
    assert m.cached_len == 64 and m.snapshot_slot == a_snaps[64]
    b_pages, b_snaps, result = put(cache, b, [128], pages=m.pages)
    assert result.freed_pages == [] and result.unused_slots == []
    assert cache.stats().n_nodes == 3  # [0, 64) with its snapshot, then the two tails
    assert cache.match(a + [1]).pages == a_pages
    assert cache.match(b + [1]).pages == b_pages == a_pages[:4] + b_pages[4:]
    assert cache.match(b + [1]).snapshot_slot == b_snaps[128]


def test_a_fork_inside_a_page_shares_only_the_whole_pages_before_it():
    cache = make_cache(16, grid=16)
    a = tokens(64, seed=9)
    b = a[:40] + tokens(24, seed=10)  # diverges inside page [32, 48)
    a_pages, _, _ = put(cache, a, [16, 32, 48, 64])
    b_pages, _, result = put(cache, b, [48, 64], pages=a_pages[:2])
    assert result.freed_pages == []
    assert cache.match(b + [1]).pages == a_pages[:2] + b_pages[2:]
    assert cache.stats().n_pages == 4 + 2


def test_a_duplicate_insert_frees_only_the_pages_that_are_not_the_trees():
    cache = make_cache(16)
    ids = tokens(128, seed=11)
    pages, snaps, _ = put(cache, ids, [64, 128])
    m = cache.match(ids + [1])  # a second request resumes at 128 and recomputes nothing...
    again, again_snaps, result = put(cache, ids, [64, 128], pages=m.pages[:2])
    assert result.freed_pages == again[2:]  # ...but brought its own pages from 32 on
    assert result.unused_slots == [again_snaps[64], again_snaps[128]]
    assert cache.match(ids + [1]).pages == pages
    cache.page_pool.free(result.freed_pages)
    for slot in result.unused_slots:
        cache.state_pool.free(slot)
    cache.check_integrity()


def test_inserting_the_trees_own_snapshot_slot_again_returns_nothing():
    cache = make_cache(16)
    ids = tokens(64, seed=12)
    pages, snaps, _ = put(cache, ids, [64])
    result = cache.insert(ids, pages, {64: snaps[64]})
    assert result == ([], [], [])


def test_snapshot_depths_off_the_grid_are_refused_before_anything_changes():
    cache = make_cache(16)
    ids = tokens(96, seed=13)
    pages = cache.page_pool.allocate(6)
    with pytest.raises(AssertionError, match="grid"):
        cache.insert(ids, pages, {48: cache.state_pool.allocate()})
    assert cache.stats().n_nodes == 0


def test_locked_paths_survive_eviction_and_flush():
    cache = make_cache(16)
    a, b = tokens(128, seed=14), tokens(128, seed=15)
    put(cache, a, [64, 128])
    put(cache, b, [128])
    m = cache.match(a[:100])
    cache.lock(m.node)
    assert (cache.evictable_pages(), cache.evictable_slots()) == (8 + 4, 1 + 1)
    assert tuple(cache.flush()) == (12, 2, 0, 0)
    assert cache.match(a[:100]).cached_len == 64 and cache.stats().n_pages == 4
    cache.unlock(m.node)
    assert tuple(cache.flush()) == (4, 1, 0, 0)
    assert cache.page_pool.num_free == cache.page_pool.num_pages - 1
    cache.check_integrity()


def test_unlocking_more_often_than_locking_is_an_assertion():
    cache = make_cache(16)
    ids = tokens(64, seed=16)
    put(cache, ids, [64])
    m = cache.match(ids + [1])
    cache.lock(m.node)
    cache.unlock(m.node)
    with pytest.raises(AssertionError):
        cache.unlock(m.node)


def test_a_split_keeps_locks_snapshots_and_the_held_node():
    cache = make_cache(16)
    ids = tokens(128, seed=17)
    put(cache, ids, [128])
    m = cache.match(ids + [1])
    cache.lock(m.node)
    put(cache, ids[:64] + tokens(64, seed=18), [64])  # splits the locked edge at 64
    assert m.node.depth == 128 and m.node.parent.depth == 64
    assert m.node.parent.lock_count == 1 and m.node.snapshot_slot == m.snapshot_slot
    cache.unlock(m.node)
    cache.check_integrity()
    assert cache.tree.root.lock_count == 0


def test_evict_frees_the_least_recently_used_leaf_first():
    now = [0]
    cache = make_cache(16, clock=lambda: now[0])
    a, b = tokens(64, seed=19), tokens(64, seed=20)
    now[0] = 1
    put(cache, a, [64])
    now[0] = 2
    put(cache, b, [64])
    now[0] = 3
    cache.match(a + [1])  # a is now the more recent
    assert tuple(cache.evict(n_pages=1)) == (4, 1, 0, 0)  # a whole leaf goes, with its snapshot
    assert cache.match(a + [1]).cached_len == 64 and cache.match(b + [1]).cached_len == 0


def test_evicting_slots_drops_an_inner_snapshot_but_keeps_the_node_and_its_pages():
    cache = make_cache(16)
    ids = tokens(128, seed=21)
    put(cache, ids, [64])  # inner node [0, 64) with the snapshot, leaf [64, 128) without
    assert cache.evict(n_slots=1) == (0, 1, 0, 0)
    assert tuple(cache.stats()) == (8, 0, 2, 0, 0)
    assert cache.match(ids + [1]).cached_len == 0


def test_evicting_slots_takes_a_leafs_snapshot_with_its_pages_deepest_first_on_a_tie():
    cache = make_cache(16)
    ids = tokens(128, seed=22)
    put(cache, ids, [64, 128])  # one insert: both nodes have the same last-access time
    assert cache.evict(n_slots=1) == (4, 1, 0, 0)
    assert cache.match(ids + [1]).cached_len == 64


def test_evicting_slots_skips_locked_snapshots():
    cache = make_cache(16)
    ids = tokens(128, seed=23)
    put(cache, ids, [64, 128])
    m = cache.match(ids + [1])
    cache.lock(m.node)
    assert cache.evict(n_slots=2) == (0, 0, 0, 0)
    cache.unlock(m.node)
    cache.lock(cache.tree.root)  # locking the root protects nothing
    assert cache.evict(n_slots=2) == (8, 2, 0, 0)
    cache.unlock(cache.tree.root)
    cache.check_integrity()


def test_the_key_fn_hook_maps_ids_to_keys_for_match_and_insert():
    def lookahead(ids: list[int]) -> list[int]:
        return [a << 32 | b for a, b in zip(ids, ids[1:], strict=False)]

    cache = make_cache(16, key_fn=lookahead)
    ids = tokens(129, seed=23)  # 128 keys: the last pairs token 127 with token 128
    put(cache, ids, [64, 128])
    assert cache.match(ids).cached_len == 128
    # forking right after 128 tokens: key 127 pairs with the new token, so it misses
    fork = ids[:128] + [ids[128] + 1, 5, 6]
    assert cache.match(fork).cached_len == 64
    token_keyed = make_cache(16)
    put(token_keyed, ids[:128], [64, 128])
    assert token_keyed.match(fork).cached_len == 128


def test_check_integrity_catches_a_cached_page_that_the_pool_calls_free():
    cache = make_cache(16)
    pages, _, _ = put(cache, tokens(64, seed=24), [64])
    cache.page_pool.free(pages[:1])  # a bug elsewhere frees a page the tree owns
    with pytest.raises(AssertionError, match="free in the pool"):
        cache.check_integrity()


def test_check_integrity_catches_a_lock_count_below_a_childs():
    cache = make_cache(16)
    ids = tokens(128, seed=25)
    put(cache, ids, [64, 128])
    node = cache.match(ids + [1]).node
    node.lock_count = 1  # a lock that skipped the ancestors
    with pytest.raises(AssertionError, match="below its children"):
        cache.check_integrity()


def test_stats_count_pages_snapshots_nodes_and_locked_nodes():
    cache = make_cache(16)
    ids = tokens(128, seed=26)
    put(cache, ids, [64, 128])
    cache.lock(cache.match(ids[:100]).node)
    assert tuple(cache.stats()) == (8, 2, 2, 1, 0)


def test_a_slot_the_tree_holds_at_another_depth_is_refused_before_anything_changes():
    cache = make_cache(16)
    ids = tokens(128, seed=27)
    pages, snaps, _ = put(cache, ids, [64])
    other = tokens(64, seed=28)
    with pytest.raises(AssertionError, match="another depth"):
        cache.insert(other, cache.page_pool.allocate(4), {64: snaps[64]})
    assert tuple(cache.stats()) == (8, 1, 2, 0, 0)
