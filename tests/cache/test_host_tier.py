"""PrefixCache with a host bank: eviction moves snapshots to it, match and restore use them,
a full bank gives up least recently used paths first and keeps snapshots spread on a path."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.host_bank import BankUsage, HostSnapshotBank
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import GDNStatePool
from token_ids import random_tokens


def make_cache(bank_slots: int, page_size: int = 16, num_slots: int = 32) -> PrefixCache:
    pages = PagePool(1 + 4096 // page_size, page_size)
    # L=2, HV=2, V=3, K=4, conv D=5, W=3, bf16 conv: every axis distinct
    slots = GDNStatePool(2, num_slots, 2, 3, 4, 5, 3, conv_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    slots.recurrent.copy_(torch.randn(slots.recurrent.shape, generator=gen))
    slots.conv.copy_(torch.randn(slots.conv.shape, generator=gen))
    return PrefixCache(pages, slots, page_size, grid=64,
                       host_bank=HostSnapshotBank.like(slots, bank_slots))


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, vocab=1000)


def put(cache: PrefixCache, ids: list[int], depths: list[int]) -> dict[int, int]:
    """Insert `ids` with fresh pages and a fresh (randomly filled) slot per snapshot depth."""
    pages = cache.page_pool.allocate(len(ids) // cache.page_size)
    snaps = {d: cache.state_pool.allocate() for d in depths}
    assert cache.insert(ids, pages, snaps) == ([], [], [])
    cache.check_integrity()
    return snaps


def state(cache: PrefixCache, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.state_pool.recurrent[:, slot].clone(), cache.state_pool.conv[:, slot].clone()


def restored(cache: PrefixCache, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Match `ids` and restore the match into a fresh device slot; that slot's state."""
    slot = cache.state_pool.allocate()
    cache.restore(cache.match(ids), slot)
    out = state(cache, slot)
    cache.state_pool.free(slot)
    return out


def host_depths(cache: PrefixCache, path: list[int] | None = None) -> list[int]:
    """Depths of the host snapshots in the tree (on the cached path of `path`, if given)."""
    nodes = cache.tree.nodes() if path is None else cache.tree.match_path(path)
    return sorted(n.depth for n in nodes if n.host_slot is not None)


def test_evicting_a_device_snapshot_moves_it_to_the_bank_where_match_and_restore_find_it():
    cache = make_cache(bank_slots=2)
    ids = tokens(128, seed=1)
    snaps = put(cache, ids, [64, 128])
    want = state(cache, snaps[128])
    free_before = cache.state_pool.num_free
    assert tuple(cache.evict(n_slots=1)) == (0, 1, 1, 0)  # moved, not dropped
    assert cache.state_pool.num_free == free_before + 1 and not cache.state_pool.is_allocated(
        snaps[128])
    cache.state_pool.recurrent[:, snaps[128]] = 7.0  # the freed slot is reused at once
    m = cache.match(ids + [1])
    assert (m.cached_len, m.snapshot_slot, m.host_slot) == (128, None, 0)
    assert len(m.pages) == 8
    got = restored(cache, ids + [1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # bitwise, all layers
    assert cache.match(ids + [1]).host_slot == 0  # restore leaves the snapshot in the bank
    assert tuple(cache.stats()) == (8, 1, 2, 0, 1)
    assert cache.host_usage() == BankUsage(1, 2, cache.host_bank.bytes_per_slot,
                                           2 * cache.host_bank.bytes_per_slot)
    cache.check_integrity()


def test_restore_copies_a_device_snapshot_and_zeroes_on_a_miss():
    cache = make_cache(bank_slots=2)
    ids = tokens(64, seed=2)
    snaps = put(cache, ids, [64])
    got = restored(cache, ids + [1])
    assert all(torch.equal(g, w) for g, w in zip(got, state(cache, snaps[64]), strict=True))
    got = restored(cache, tokens(64, seed=3))
    assert not got[0].any() and not got[1].any()


def test_restore_of_a_match_gone_stale_is_an_assertion():
    cache = make_cache(bank_slots=2)
    ids = tokens(64, seed=4)
    put(cache, ids, [64])
    m = cache.match(ids + [1])  # not locked: eviction moves its snapshot
    cache.evict(n_slots=1)
    with pytest.raises(AssertionError, match="stale match"):
        cache.restore(m, cache.state_pool.allocate())


def test_a_full_bank_gives_up_the_least_recently_used_path_first():
    cache = make_cache(bank_slots=2)
    a, b, c = tokens(64, seed=5), tokens(64, seed=6), tokens(64, seed=7)
    for ids in (a, b, c):
        put(cache, ids, [64])
    assert tuple(cache.evict(n_slots=2)) == (0, 2, 2, 0)  # a and b move; the bank is full
    # c moves too, and a (the oldest) goes first, with its leaf's pages
    assert tuple(cache.evict(n_slots=1)) == (4, 1, 1, 1)
    assert [cache.match(ids + [1]).cached_len for ids in (a, b, c)] == [0, 64, 64]
    assert cache.host_bank.num_free == 0
    cache.check_integrity()


def test_a_device_snapshot_older_than_the_whole_bank_is_dropped_instead_of_moved():
    cache = make_cache(bank_slots=1)
    a, b = tokens(128, seed=8), tokens(64, seed=9)
    put(cache, a, [64])  # inner snapshot: its node keeps its pages when dropped
    put(cache, b, [64])
    cache.match(b + [1])
    cache.evict(n_slots=1)  # a is the least recently used device snapshot: moved
    cache.match(a + [1])  # now a's host snapshot is newer than b's device snapshot
    assert tuple(cache.evict(n_slots=1)) == (4, 1, 0, 0)  # b's leaf dropped, nothing moved
    assert host_depths(cache) == [64] and cache.match(a + [1]).host_slot is not None


def test_a_full_bank_keeps_a_paths_deepest_snapshot_and_the_others_spread_out():
    cache = make_cache(bank_slots=4)
    path = tokens(512, seed=10)
    put(cache, path, [64, 128, 192, 448])  # one insert: all four tied on last access
    cache.evict(n_slots=4)
    assert host_depths(cache) == [64, 128, 192, 448]
    dropped = []
    for seed in range(4):  # each newer snapshot moving in makes the bank give one up
        put(cache, tokens(64, seed=100 + seed), [64])
        before = host_depths(cache, path)
        assert tuple(cache.evict(n_slots=1)) == (0, 1, 1, 1)
        dropped += sorted(set(before) - set(host_depths(cache, path)))
    # gaps 64, 64, 64 (448 kept as the deepest): the shallowest of the smallest gap, 64;
    # then 128 has a gap of 128 and 192 of 64: 192; then 128; the deepest last
    assert dropped == [64, 192, 128, 448]
    cache.check_integrity()


def test_the_gap_is_measured_to_the_snapshot_above_on_either_tier():
    cache = make_cache(bank_slots=3)
    path = tokens(512, seed=11)
    put(cache, path, [128, 192, 320, 448])
    cache.evict(n_slots=3)  # deepest first on a tie: 448, 320, 192 move; 128 stays
    assert host_depths(cache) == [192, 320, 448]
    put(cache, tokens(64, seed=12), [64])
    held = cache.match(path[:129])  # keeps 128 on the device (the path is newer now...)
    cache.lock(held.node)
    for n in held.node.children.values():  # ...but not below it: keep that tied as before
        assert n.last_access < held.node.last_access
    cache.evict(n_slots=1)  # 192 is 64 above the device snapshot at 128; 320 is 128 above
    assert host_depths(cache) == [64, 320, 448]
    cache.unlock(held.node)


def test_locked_snapshots_are_never_moved_or_dropped_from_the_bank():
    cache = make_cache(bank_slots=1)
    a, b, c = tokens(64, seed=13), tokens(128, seed=14), tokens(64, seed=15)
    put(cache, a, [64])
    cache.evict(n_slots=1)
    m = cache.match(a + [1])  # a host hit, being restored: locked
    cache.lock(m.node)
    put(cache, b, [64, 128])
    held = cache.match(b[:65])
    cache.lock(held.node)  # b's snapshot at 64 stays on the device
    assert cache.evictable_slots() == 1  # b's 128 only
    put(cache, c, [64])
    # the full bank keeps a: b's 128 and c's 64 are dropped, with their leaves
    assert tuple(cache.evict(n_slots=3)) == (8, 2, 0, 0)
    assert host_depths(cache) == [64] and cache.match(a + [1]).host_slot == m.host_slot
    assert held.node.snapshot_slot == held.snapshot_slot
    assert tuple(cache.flush()) == (0, 0, 0, 0)
    cache.unlock(m.node)
    cache.unlock(held.node)
    assert tuple(cache.flush()) == (8, 1, 0, 1)
    assert cache.host_bank.num_free == 1 and cache.state_pool.num_free == 31
    cache.check_integrity()


def test_evicting_a_leaf_by_pages_drops_its_host_snapshot_and_frees_the_host_slot():
    cache = make_cache(bank_slots=2)
    ids = tokens(128, seed=16)
    put(cache, ids, [64, 128])
    cache.evict(n_slots=2)
    assert cache.host_bank.num_free == 0
    assert tuple(cache.evict(n_pages=1)) == (4, 0, 0, 1)  # the leaf [64, 128) and its 128
    assert cache.host_bank.num_free == 1 and host_depths(cache) == [64]
    assert tuple(cache.flush()) == (4, 0, 0, 1)  # flush drops both tiers, moves nothing
    assert cache.host_bank.num_free == 2 and tuple(cache.stats()) == (0, 0, 0, 0, 0)
    cache.check_integrity()


def test_flush_drops_device_snapshots_without_moving_them():
    cache = make_cache(bank_slots=4)
    put(cache, tokens(128, seed=17), [64, 128])
    assert tuple(cache.flush()) == (8, 2, 0, 0) and cache.host_bank.num_free == 4


def test_inserting_a_device_slot_where_a_host_snapshot_is_returns_the_slot_unused():
    cache = make_cache(bank_slots=2)
    ids = tokens(64, seed=18)
    put(cache, ids, [64])
    cache.evict(n_slots=1)
    again = cache.state_pool.allocate()
    pages = cache.match(ids).pages + cache.page_pool.allocate(4)
    result = cache.insert(ids, pages, {64: again})
    assert result.unused_slots == [again] and host_depths(cache) == [64]


def test_check_integrity_catches_a_snapshot_on_both_tiers_and_a_host_slot_free_in_the_bank():
    cache = make_cache(bank_slots=2)
    ids = tokens(128, seed=19)
    put(cache, ids, [64, 128])
    cache.evict(n_slots=1)
    node = cache.match(ids + [1]).node
    cache.host_bank.free(node.host_slot)  # a bug elsewhere frees a slot the tree owns
    with pytest.raises(AssertionError, match="free in the bank"):
        cache.check_integrity()
    cache.host_bank.allocate()
    node.parent.host_slot = 1  # and one that attaches a host slot beside a device slot
    with pytest.raises(AssertionError, match="both tiers"):
        cache.check_integrity()


def test_without_a_bank_evicting_a_snapshot_drops_it_and_match_reports_no_host_slot():
    cache = PrefixCache(PagePool(64, 16), GDNStatePool(1, 8, 1, 1, 1, 1, 2), 16)
    ids = tokens(128, seed=20)
    put(cache, ids, [64, 128])
    assert tuple(cache.evict(n_slots=1)) == (4, 1, 0, 0)
    assert cache.match(ids + [1]).host_slot is None
    assert cache.host_usage() == BankUsage(0, 0, 0, 0)


def test_a_paths_deepest_snapshot_is_kept_even_when_it_is_nearest_the_one_above():
    cache = make_cache(bank_slots=3)
    path = tokens(384, seed=21)
    put(cache, path, [128, 256, 320])  # gaps 128, 128, 64: 320 is nearest, but the deepest
    cache.evict(n_slots=3)
    put(cache, tokens(64, seed=22), [64])
    cache.evict(n_slots=1)
    assert host_depths(cache, path) == [256, 320]
