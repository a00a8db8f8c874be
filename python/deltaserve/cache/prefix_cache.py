"""The hybrid prefix cache: a radix tree of KV pages plus GDN snapshots on the chunk grid.

A cached prefix is usable only up to a snapshot: resuming at depth L needs the KV of [0, L)
*and* the GDN state after exactly L tokens. So `match` returns the deepest snapshot strictly
shorter than the prompt (its last token is always recomputed, to produce logits), and only the
pages below it. Snapshots sit at multiples of `lcm(grid, page_size)` tokens.

Ownership: pages and slots handed to `insert` belong to the tree until eviction frees them
into their pools. Pages and the snapshot of a locked node (a node on the path of a running
request's match) are never evicted.

Lengths and depths are in keys, which are tokens for the default (identity) `key_fn`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from deltaserve.cache.radix import RadixNode, RadixTree

if TYPE_CHECKING:
    from deltaserve.cache.page_pool import PagePool
    from deltaserve.cache.state_pool import GDNStatePool


class PrefixMatch(NamedTuple):
    node: RadixNode  # lock it to keep pages and snapshot; valid until the next mutation else
    cached_len: int  # tokens restored: the snapshot depth, < len(ids); 0 on a miss
    pages: list[int]  # cached_len // page_size page ids covering [0, cached_len)
    snapshot_slot: int | None  # GDN state after exactly cached_len tokens; None iff 0


class InsertResult(NamedTuple):
    freed_pages: list[int]  # caller pages the tree did not take (it had its own): free them
    unused_slots: list[int]  # caller slots the tree did not take (it had a snapshot there)


class EvictResult(NamedTuple):
    n_pages: int  # pages returned to the page pool
    n_slots: int  # snapshot slots returned to the state pool


class CacheStats(NamedTuple):
    n_pages: int
    n_snapshots: int
    n_nodes: int  # root excluded
    n_locked_nodes: int


class PrefixCache:
    """Radix tree over `key_fn(ids)` with pages, snapshots, locks and LRU eviction.

    `key_fn` maps token ids to radix keys (identity when None; lookahead keys pack pairs and
    may return one key less than ids). `clock` gives last-access times (default: a counter,
    so LRU order is deterministic); it must not decrease, so an ancestor is never older than
    its descendants.
    """

    def __init__(self, page_pool: PagePool, state_pool: GDNStatePool, page_size: int,
                 grid: int = 64, key_fn: Callable[[list[int]], list[int]] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        assert page_pool.page_size == page_size, (page_pool.page_size, page_size)
        assert grid >= 1
        self.page_pool, self.state_pool, self.page_size = page_pool, state_pool, page_size
        self.snapshot_step = math.lcm(grid, page_size)  # snapshot depths are multiples
        self.key_fn = key_fn
        self.clock = clock if clock is not None else itertools.count(1).__next__
        self.tree = RadixTree(page_size)

    def _keys(self, ids: Sequence[int]) -> list[int]:
        return list(self.key_fn(list(ids))) if self.key_fn is not None else list(ids)

    # ---- lookup -------------------------------------------------------------------------
    def match(self, ids: Sequence[int]) -> PrefixMatch:
        """Deepest node on the cached path of `ids` holding a snapshot at depth L < len(ids).

        Mutates only last-access times (of the returned node and its ancestors). The result
        stays valid until the next `insert`/`evict`/`flush` unless `lock(match.node)` is
        called first; keys beyond L (even if cached) are not returned or touched.
        """
        assert len(ids) >= 1, "match of an empty prompt"
        keys = self._keys(ids)[:len(ids) - 1]
        best = self.tree.root
        for node in self.tree.match_path(keys):
            if node.snapshot_slot is not None:
                best = node
        self.tree.touch(best, self.clock())
        return PrefixMatch(best, best.depth, self.tree.path_pages(best), best.snapshot_slot)

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors (pages and snapshots) from eviction; counts nest.
        Locking the root is allowed and protects nothing."""
        self.tree.lock(node)

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; asserts the counts stay >= 0. The node stays in the tree
        (now evictable if no other lock covers it)."""
        self.tree.unlock(node)

    # ---- insert -------------------------------------------------------------------------
    def insert(self, ids: Sequence[int], pages: Sequence[int],
               snapshots: dict[int, int] | None = None) -> InsertResult:
        """Cache `ids` with KV `pages` and GDN `snapshots` {depth: slot}; touch the path.

        `len(keys)` is a page multiple, `pages[i]` holds positions [i*page_size, (i+1)*
        page_size); snapshot depths are multiples of lcm(grid, page_size) in (0, len(keys)].
        The tree takes every page and slot it did not have; it returns the caller's page for
        a position it already caches only when the ids differ (leading pages that came from
        the tree via `match` are not returned), and the caller's slot for a depth that
        already has a snapshot. Nodes may split; existing nodes (and locks on them) stay
        valid.
        """
        keys, pages = self._keys(ids), list(pages)
        snapshots = snapshots or {}
        for depth, slot in snapshots.items():
            assert 0 < depth <= len(keys) and depth % self.snapshot_step == 0, (
                f"snapshot depth {depth} not on the {self.snapshot_step}-grid in "
                f"(0, {len(keys)}]")
            assert self.state_pool.is_allocated(slot), f"snapshot slot {slot} not allocated"
        assert len(set(snapshots.values())) == len(snapshots), "one slot for two depths"
        held = {n.depth: n.snapshot_slot for n in self.tree.match_path(keys)}
        for depth, slot in snapshots.items():  # checked before anything changes
            assert slot not in self.tree.slots or held.get(depth) == slot, (
                f"slot {slot} is already the tree's snapshot at another depth")
        _, freed = self.tree.insert(keys, pages, self.clock())
        unused = []
        for depth in sorted(snapshots):
            slot, node = snapshots[depth], self.tree.node_at(keys, depth)
            if node.snapshot_slot is None:
                self.tree.set_snapshot(node, slot)
            elif node.snapshot_slot != slot:
                unused.append(slot)
        return InsertResult(freed, unused)

    # ---- eviction -----------------------------------------------------------------------
    def evictable_pages(self) -> int:
        """Pages `evict` could free now (every page of an unlocked node)."""
        return len(self.tree.pages) - self.tree.num_locked_pages

    def evictable_slots(self) -> int:
        """Snapshot slots `evict` could free now (every snapshot of an unlocked node)."""
        return len(self.tree.slots) - self.tree.num_locked_slots

    def _priority(self, node: RadixNode) -> tuple[float, int, int]:
        """Eviction order: least recently used first; on a tie (one path touched at once)
        the deeper node first; then creation order."""
        return (node.last_access, -node.depth, node.uid)

    def _free_pages(self, pages: list[int]) -> None:
        self.page_pool.free(pages)

    def _free_slot(self, slot: int) -> None:
        self.state_pool.free(slot)

    def _drop_leaf(self, leaf: RadixNode) -> EvictResult:
        n_slots = 0
        if leaf.snapshot_slot is not None:
            self._free_slot(self.tree.clear_snapshot(leaf))
            n_slots = 1
        pages = self.tree.remove_leaf(leaf)
        self._free_pages(pages)
        return EvictResult(len(pages), n_slots)

    def _heap(self, nodes: Iterable[RadixNode]) -> list[tuple[tuple, RadixNode]]:
        heap = [(self._priority(n), n) for n in nodes]
        heapq.heapify(heap)
        return heap

    def evict(self, n_pages: int = 0, n_slots: int = 0) -> EvictResult:
        """Free unlocked cache entries into the pools until `n_pages` pages and `n_slots`
        slots have been freed, or nothing unlocked is left.

        Pages: removes least-recently-used unlocked leaves (with their snapshots), a parent
        becoming a leaf joins the candidates. Slots still short: takes the least-recently-
        used unlocked snapshots; a leaf's goes with the leaf (its pages are useless without
        it), an inner node keeps its pages and children. Locked nodes and every node handed
        out by `match` and locked stay valid; other PrefixMatch results may not.
        Returns what was freed (it may exceed the request by part of a leaf).
        """
        assert n_pages >= 0 and n_slots >= 0
        freed_pages = freed_slots = 0
        tree = self.tree
        if n_pages > 0:
            heap = self._heap(n for n in tree.nodes() if n.is_leaf and n.lock_count == 0)
            while freed_pages < n_pages and heap:
                _, leaf = heapq.heappop(heap)
                parent = leaf.parent
                got = self._drop_leaf(leaf)
                freed_pages, freed_slots = freed_pages + got.n_pages, freed_slots + got.n_slots
                if parent is not tree.root and parent.is_leaf and parent.lock_count == 0:
                    heapq.heappush(heap, (self._priority(parent), parent))
        if freed_slots < n_slots:
            heap = self._heap(n for n in tree.nodes()
                              if n.snapshot_slot is not None and n.lock_count == 0)
            while freed_slots < n_slots and heap:
                _, node = heapq.heappop(heap)
                if node.is_leaf:
                    got = self._drop_leaf(node)
                    freed_pages, freed_slots = freed_pages + got.n_pages, freed_slots + 1
                else:
                    self._free_slot(tree.clear_snapshot(node))
                    freed_slots += 1
        return EvictResult(freed_pages, freed_slots)

    def flush(self) -> EvictResult:
        """Evict everything unlocked; locked paths and their snapshots stay."""
        return self.evict(self.evictable_pages(), self.evictable_slots())

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> CacheStats:
        nodes = list(self.tree.nodes())
        return CacheStats(len(self.tree.pages), len(self.tree.slots), len(nodes),
                          sum(n.lock_count > 0 for n in nodes))

    def check_integrity(self) -> None:
        """The tree's structure (RadixTree.check_integrity), both pools' own checks, every
        tree page and slot allocated in its pool (so neither free nor owned by the pool's
        free list), every snapshot at a non-root node on the snapshot grid."""
        self.tree.check_integrity()
        self.page_pool.check_integrity()
        self.state_pool.check_integrity()
        for page in self.tree.pages:
            assert self.page_pool.is_allocated(page), f"tree page {page} is free in the pool"
        for slot in self.tree.slots:
            assert self.state_pool.is_allocated(slot), f"tree slot {slot} is free in the pool"
        for node in self.tree.nodes():
            if node.snapshot_slot is not None:
                assert node.depth % self.snapshot_step == 0, f"snapshot off the grid: {node}"
