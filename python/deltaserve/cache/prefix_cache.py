"""The hybrid prefix cache: a radix tree of KV pages plus GDN snapshots on the chunk grid.

A cached prefix is usable only up to a snapshot: resuming at depth L needs the KV of [0, L)
*and* the GDN state after exactly L tokens. So `match` returns the deepest snapshot strictly
shorter than the prompt (its last token is always recomputed, to produce logits), and only the
pages below it. Snapshots sit at multiples of `lcm(grid, page_size)` tokens.

Two tiers of snapshots: device slots of the GDNStatePool and, with a `host_bank`, host slots
of a HostSnapshotBank. A node holds at most one snapshot, on one tier. Evicting a device
snapshot moves it to the bank when there is one (dropping a host snapshot first if the bank is
full, in host_policy's order); `match` finds snapshots on either tier and `restore` copies
or loads the matched one into a request's device slot.

Ownership: pages and slots handed to `insert` belong to the tree until eviction frees them
into their pools. Pages and the snapshot of a locked node (a node on the path of a running
request's match) are never evicted, moved or dropped.

Lengths and depths are in keys, which are tokens for the default (identity) `key_fn`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from deltaserve.cache.host_bank import BankUsage
from deltaserve.cache.host_policy import DropKey, HostDropQueue, drop_key
from deltaserve.cache.radix import RadixNode, RadixTree

if TYPE_CHECKING:
    from deltaserve.cache.host_bank import HostSnapshotBank
    from deltaserve.cache.page_pool import PagePool
    from deltaserve.cache.state_pool import GDNStatePool


class PrefixMatch(NamedTuple):
    node: RadixNode  # lock it to keep pages and snapshot; valid until the next mutation else
    cached_len: int  # tokens restored: the snapshot depth, < len(ids); 0 on a miss
    pages: list[int]  # cached_len // page_size page ids covering [0, cached_len)
    snapshot_slot: int | None  # device slot with the GDN state after exactly cached_len tokens
    host_slot: int | None = None  # or the bank slot with it; exactly one set iff cached_len > 0
    # keys of ids[:len(ids) - 1] on the tree's KV path (a page multiple >= cached_len): where
    # the cached path leaves ids, or ends; the scheduler's fork snapshots aim below it
    path_len: int = 0


class InsertResult(NamedTuple):
    freed_pages: list[int]  # caller pages the tree did not take (it had its own): free them
    unused_slots: list[int]  # caller slots the tree did not take (it had a snapshot there)
    unused_host_slots: Sequence[int] = ()  # the same for host bank slots


class EvictResult(NamedTuple):
    n_pages: int  # pages returned to the page pool
    n_slots: int  # device snapshot slots returned to the state pool (moved or dropped)
    n_moved: int = 0  # of those, snapshots moved to the host bank (not dropped)
    n_host_slots: int = 0  # host snapshots dropped: slots returned to the bank


class CacheStats(NamedTuple):
    n_pages: int
    n_snapshots: int  # on the device
    n_nodes: int  # root excluded
    n_locked_nodes: int
    n_host_snapshots: int = 0  # in the host bank


class PrefixCache:
    """Radix tree over `key_fn(ids)` with pages, snapshots, locks and LRU eviction.

    `key_fn` maps token ids to radix keys (identity when None; lookahead keys pack pairs and
    may return one key less than ids). `clock` gives last-access times (default: a counter,
    so LRU order is deterministic); it must not decrease, so an ancestor is never older than
    its descendants. `host_bank` (None: one tier) receives evicted device snapshots; it must
    have `state_pool`'s per-slot layout (HostSnapshotBank.like) and serve this cache alone.
    """

    def __init__(self, page_pool: PagePool, state_pool: GDNStatePool, page_size: int,
                 grid: int = 64, key_fn: Callable[[list[int]], list[int]] | None = None,
                 clock: Callable[[], float] | None = None,
                 host_bank: HostSnapshotBank | None = None) -> None:
        assert page_pool.page_size == page_size, (page_pool.page_size, page_size)
        assert grid >= 1
        self.page_pool, self.state_pool, self.page_size = page_pool, state_pool, page_size
        self.host_bank = host_bank
        self.snapshot_step = math.lcm(grid, page_size)  # snapshot depths are multiples
        self.key_fn = key_fn
        self.clock = clock if clock is not None else itertools.count(1).__next__
        self.tree = RadixTree(page_size)

    def _keys(self, ids: Sequence[int]) -> list[int]:
        return list(self.key_fn(list(ids))) if self.key_fn is not None else list(ids)

    # ---- lookup -------------------------------------------------------------------------
    def match(self, ids: Sequence[int]) -> PrefixMatch:
        """Deepest node on the cached path of `ids` holding a snapshot (either tier) at depth
        L < len(ids). O(path).

        Mutates only last-access times (of the returned node and its ancestors). The result
        stays valid until the next `insert`/`evict`/`flush` unless `lock(match.node)` is
        called first; keys beyond L (even if cached) are not returned or touched.
        """
        assert len(ids) >= 1, "match of an empty prompt"
        keys = self._keys(ids)[:len(ids) - 1]
        best = self.tree.root
        for node in self.tree.match_path(keys):
            if node.has_snapshot:
                best = node
        self.tree.touch(best, self.clock())
        return PrefixMatch(best, best.depth, self.tree.path_pages(best), best.snapshot_slot,
                           best.host_slot, self.tree.path_len(keys))

    def restore(self, match: PrefixMatch, dst_slot: int) -> None:
        """Write the GDN state after exactly `match.cached_len` tokens into allocated device
        slot `dst_slot`: a device copy of `match.snapshot_slot`, a bank load of
        `match.host_slot`, or zeros on a miss. Ordered before the work enqueued next on the
        current stream (see HostSnapshotBank for the load's ordering); the host thread does not
        wait. `match` must still be current (asserted): lock its node before anything that
        may evict. The snapshot stays where it was."""
        node = match.node
        assert (node.snapshot_slot, node.host_slot) == (match.snapshot_slot, match.host_slot), (
            f"stale match: {match.snapshot_slot, match.host_slot} but the node is {node}")
        if match.snapshot_slot is not None:
            self.state_pool.copy(match.snapshot_slot, dst_slot)
        elif match.host_slot is not None:
            assert self.host_bank is not None
            self.host_bank.load(match.host_slot, self.state_pool, dst_slot)
        else:
            self.state_pool.zero(dst_slot)

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
               snapshots: dict[int, int] | None = None,
               host_snapshots: dict[int, int] | None = None) -> InsertResult:
        """Cache `ids` with KV `pages` and GDN `snapshots` {depth: slot}; touch the path.

        `len(keys)` is a page multiple, `pages[i]` holds positions [i*page_size, (i+1)*
        page_size); snapshot depths are multiples of lcm(grid, page_size) in (0, len(keys)].
        The tree takes every page and slot it did not have; it returns the caller's page for
        a position it already caches only when the ids differ (leading pages that came from
        the tree via `match` are not returned), and the caller's slot for a depth that
        already has a snapshot (on either tier: a host snapshot is not replaced). `snapshots`
        holds device slots; `host_snapshots` {depth: host slot} bank slots (prefill snapshots
        stored there when no device slot was free), taken on the same terms, at depths
        `snapshots` does not name. Nodes may split; existing nodes (and locks on them) stay
        valid.
        """
        keys, pages = self._keys(ids), list(pages)
        snapshots, host_snapshots = snapshots or {}, host_snapshots or {}
        assert not set(snapshots) & set(host_snapshots), "two snapshots at one depth"
        for depth, slot in host_snapshots.items():
            assert 0 < depth <= len(keys) and depth % self.snapshot_step == 0, depth
            assert self.host_bank is not None and self.host_bank.is_allocated(slot), (
                f"host slot {slot} not allocated in a bank")
            assert slot not in self.tree.host_slots, f"host slot {slot} already in the tree"
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
        unused, unused_host = [], []
        for depth in sorted(snapshots):
            slot, node = snapshots[depth], self.tree.node_at(keys, depth)
            if not node.has_snapshot:
                self.tree.set_snapshot(node, slot)
            elif node.snapshot_slot != slot:
                unused.append(slot)
        for depth in sorted(host_snapshots):
            slot, node = host_snapshots[depth], self.tree.node_at(keys, depth)
            if node.has_snapshot:
                unused_host.append(slot)
            else:
                self.tree.set_snapshot(node, slot, host=True)
        return InsertResult(freed, unused, unused_host)

    def attach(self, ids: Sequence[int], depth: int, slot: int, host: bool = False) -> bool:
        """Give the tree snapshot `slot` (a device slot, or a bank slot with `host`) holding
        the state after exactly `depth` tokens of `ids`, at the node at `depth` on the cached
        path of `ids` (splitting its edge there), before any pages of `ids` are inserted: a
        fork snapshot of a request that recomputes a prefix the tree already caches.

        `depth` is on the snapshot grid and `len(keys(ids)) >= depth` (with lookahead keys
        `ids` runs one token past `depth`). Returns True when the tree took the slot (it owns
        it now; the path up to the node is touched); False, changing nothing, when the
        cached path is shorter than `depth` (evicted meanwhile) or the node there already has
        a snapshot: the caller keeps the slot.
        """
        assert depth > 0 and depth % self.snapshot_step == 0, (
            f"snapshot depth {depth} not on the {self.snapshot_step}-grid")
        if host:
            assert self.host_bank is not None and self.host_bank.is_allocated(slot), slot
            assert slot not in self.tree.host_slots, f"host slot {slot} already in the tree"
        else:
            assert self.state_pool.is_allocated(slot), f"snapshot slot {slot} not allocated"
            assert slot not in self.tree.slots, f"slot {slot} already in the tree"
        keys = self._keys(ids)[:depth]
        assert len(keys) == depth, f"{len(keys)} keys for a snapshot at {depth}"
        if self.tree.path_len(keys) < depth:
            return False
        node = self.tree.node_at(keys, depth)
        if node.has_snapshot:
            return False
        self.tree.set_snapshot(node, slot, host=host)
        self.tree.touch(node, self.clock())
        return True

    # ---- eviction -----------------------------------------------------------------------
    def evictable_pages(self) -> int:
        """Pages `evict` could free now (every page of an unlocked node)."""
        return len(self.tree.pages) - self.tree.num_locked_pages

    def evictable_slots(self) -> int:
        """Device snapshot slots `evict` could free now (every device snapshot of an unlocked
        node: each is moved to the bank or dropped)."""
        return len(self.tree.slots) - self.tree.num_locked_slots

    def _priority(self, node: RadixNode) -> tuple[float, int, int]:
        """Eviction order: least recently used first; on a tie (one path touched at once)
        the deeper node first; then creation order."""
        return (node.last_access, -node.depth, node.uid)

    def _host_key(self, node: RadixNode) -> DropKey:
        """The order in which a full bank gives up snapshots (host_policy)."""
        return drop_key(node)

    def _free_pages(self, pages: list[int]) -> None:
        self.page_pool.free(pages)

    def _free_slot(self, slot: int) -> None:
        self.state_pool.free(slot)

    def _free_host_slot(self, slot: int) -> None:
        assert self.host_bank is not None
        self.host_bank.free(slot)

    def _drop(self, node: RadixNode) -> EvictResult:
        """Drop unlocked `node`'s snapshot (either tier, if any) and, for a leaf, the leaf
        with its pages (useless without a snapshot at their end)."""
        dev = host = None
        if node.has_snapshot:
            dev, host = self.tree.clear_snapshot(node)
            if dev is not None:
                self._free_slot(dev)
            else:
                self._free_host_slot(host)
        pages = self.tree.remove_leaf(node) if node.is_leaf else []
        self._free_pages(pages)
        return EvictResult(len(pages), int(dev is not None), 0, int(host is not None))

    def _move_to_host(self, node: RadixNode) -> None:
        """Move unlocked `node`'s device snapshot into a free bank slot."""
        assert self.host_bank is not None
        host = self.host_bank.allocate()
        self.host_bank.store(self.state_pool, node.snapshot_slot, host)
        dev, _ = self.tree.clear_snapshot(node)
        self._free_slot(dev)  # safe at once: the store is ordered before later kernels
        self.tree.set_snapshot(node, host, host=True)

    def _heap(self, nodes: Iterable[RadixNode]) -> list[tuple[tuple, RadixNode]]:
        heap = [(self._priority(n), n) for n in nodes]
        heapq.heapify(heap)
        return heap

    def evict(self, n_pages: int = 0, n_slots: int = 0) -> EvictResult:
        """Free unlocked cache entries into the pools until `n_pages` pages and `n_slots`
        device slots have been freed, or nothing unlocked is left.

        Pages: removes least-recently-used unlocked leaves with their snapshot (either tier);
        a parent becoming a leaf joins the candidates. Device slots still short: takes the
        least-recently-used unlocked device snapshots. With a host bank each one moves to the
        bank; a full bank first gives up one unlocked snapshot in host_policy's order (the
        device snapshot itself, dropped, when it comes first). Without a bank it is dropped.
        A dropped snapshot of a leaf goes with the leaf's pages; an inner node keeps its pages
        and children. Locked nodes and every node handed out by `match` and locked stay valid;
        other PrefixMatch results may not. Pages: O(tree log tree); slots: O(snapshots log
        snapshots).
        Returns what was freed (pages may exceed the request by part of a leaf).
        """
        assert n_pages >= 0 and n_slots >= 0
        tree, bank = self.tree, self.host_bank
        total = [0, 0, 0, 0]  # the EvictResult fields

        def add(got: EvictResult) -> None:
            for i, n in enumerate(got):
                total[i] += n

        if n_pages > 0:
            heap = self._heap(n for n in tree.nodes() if n.is_leaf and n.lock_count == 0)
            while total[0] < n_pages and heap:
                _, leaf = heapq.heappop(heap)
                parent = leaf.parent
                add(self._drop(leaf))
                if parent is not tree.root and parent.is_leaf and parent.lock_count == 0:
                    heapq.heappush(heap, (self._priority(parent), parent))
        if total[1] < n_slots:
            heap = self._heap(n for n in tree.slots.values() if n.lock_count == 0)
            queue = None  # the bank's drop order, built when the bank is first full
            while total[1] < n_slots and heap:
                _, node = heapq.heappop(heap)
                if bank is None:
                    add(self._drop(node))
                    continue
                if not bank.can_allocate(1):
                    if queue is None:
                        queue = HostDropQueue(tree.host_slots.values(), self._host_key)
                    victim = queue.pick(node)  # a host snapshot, or `node` itself
                    add(self._drop(victim))
                    if victim is node:
                        continue
                self._move_to_host(node)
                add(EvictResult(0, 1, 1, 0))
                if queue is not None:
                    queue.push(node)
        return EvictResult(*total)

    def flush(self) -> EvictResult:
        """Drop everything unlocked, both tiers (nothing is moved); locked paths and their
        snapshots stay. Every unlocked node has pages and only unlocked descendants, so
        evicting every evictable page takes every unlocked node with it."""
        return self.evict(n_pages=self.evictable_pages())

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Counts of what the tree holds. O(tree)."""
        nodes = list(self.tree.nodes())
        return CacheStats(len(self.tree.pages), len(self.tree.slots), len(nodes),
                          sum(n.lock_count > 0 for n in nodes), len(self.tree.host_slots))

    def host_usage(self) -> BankUsage:
        """The host bank's slots and bytes, used and total (all zero without a bank). O(1)."""
        return self.host_bank.usage() if self.host_bank is not None else BankUsage(0, 0, 0, 0)

    def check_integrity(self) -> None:
        """The tree's structure (RadixTree.check_integrity), the pools' and the bank's own
        checks, every tree page and slot (device or host) allocated in its pool or bank (so
        neither free nor on a free list), every snapshot at a non-root node on the snapshot
        grid, host snapshots only with a bank of the state pool's per-slot layout."""
        self.tree.check_integrity()
        self.page_pool.check_integrity()
        self.state_pool.check_integrity()
        for page in self.tree.pages:
            assert self.page_pool.is_allocated(page), f"tree page {page} is free in the pool"
        for slot in self.tree.slots:
            assert self.state_pool.is_allocated(slot), f"tree slot {slot} is free in the pool"
        bank = self.host_bank
        if bank is None:
            assert not self.tree.host_slots, "host snapshots without a host bank"
        else:
            bank.check_integrity()
            for pool, banked in ((self.state_pool.recurrent, bank.recurrent),
                                 (self.state_pool.conv, bank.conv)):
                assert pool.dtype == banked.dtype and pool.shape[0] == banked.shape[0] and (
                    pool.shape[2:] == banked.shape[2:]), "bank and pool slots differ in layout"
            for slot in self.tree.host_slots:
                assert bank.is_allocated(slot), f"tree host slot {slot} is free in the bank"
        for node in self.tree.nodes():
            if node.has_snapshot:
                assert node.depth % self.snapshot_step == 0, f"snapshot off the grid: {node}"
