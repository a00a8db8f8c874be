"""A session that plays the engine against PrefixCache and its reference model (RefCache).

Operations: admit = match + lock + restore + take pages and slots (evicting if short) and
write each snapshot slot with the state of its prefix; finish = insert + unlock; abort;
fork = a slot (device or host) written with the state of a cached prefix and attached to the
tree before any insert, as a request's fork snapshot is; evict; flush; drain. Each applies
to both models, compares every answer under a named tag and runs the integrity battery after
every operation: the cache's own checks, the contents per prefix and tier, an ownership
ledger of every page, device slot and host slot, and the contents of every snapshot (both
tiers), directly and through `restore`.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass

from cache_reference import Mismatch, RefCache, expect, holds_state, read_tree, write_state

from deltaserve.cache.host_bank import HostSnapshotBank
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache, PrefixMatch
from deltaserve.cache.state_pool import GDNStatePool


def _op(method):
    """Marks the session failed when an operation raises, so teardown can skip its drain."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.failed = True
            raise

    return wrapper


@dataclass
class Request:
    ids: list[int]  # the page-aligned ids it inserts when it finishes
    match: PrefixMatch
    own_pages: list[int]
    own_slots: dict[int, int]  # snapshot depth -> slot it computed


class Session:
    """The real cache and the reference side by side; see the module docstring.

    `num_slots` counts the padding slot 0; one more slot is the session's scratch slot, which
    `restore` writes to be checked. `bank_slots`: host bank size (None: no bank)."""

    def __init__(self, page_size: int, num_pages: int, num_slots: int, grid: int,
                 cache_cls: type[PrefixCache] = PrefixCache, bank_slots: int | None = None,
                 bank_cls: type[HostSnapshotBank] = HostSnapshotBank) -> None:
        self.now = 0
        self.page_pool = PagePool(num_pages, page_size)
        # 2 layers, HV=1, V=2, K=2, conv 3 channels, width 2: small, but per-layer contents
        self.state_pool = GDNStatePool(2, num_slots + 1, 1, 2, 2, 3, 2)
        self.scratch = self.state_pool.allocate()
        self.bank = (bank_cls.like(self.state_pool, bank_slots) if bank_slots is not None
                     else None)
        self.cache = cache_cls(self.page_pool, self.state_pool, page_size, grid=grid,
                               clock=lambda: self.now, host_bank=self.bank)
        self.ref = RefCache(page_size, bank_slots)
        self.ps, self.step = page_size, self.cache.snapshot_step
        self.requests: dict[int, Request] = {}
        self._rids = itertools.count()
        self.failed = False

    def _dev(self) -> tuple:
        return self.state_pool.recurrent, self.state_pool.conv

    def _host(self) -> tuple:
        assert self.bank is not None
        return self.bank.recurrent, self.bank.conv

    # ---- operations ---------------------------------------------------------------------
    @_op
    def match(self, ids: list[int]) -> PrefixMatch:
        self.now += 1
        m = self.cache.match(ids)
        depth, pages, slot, host = self.ref.match(ids, self.now)
        expect(m.cached_len == depth, "match-depth", f"{ids}: got {m.cached_len}, want {depth}")
        expect(list(m.pages) == pages, "match-pages", f"{ids}: got {m.pages}, want {pages}")
        expect((m.snapshot_slot, m.host_slot) == (slot, host), "match-slot",
               f"got {(m.snapshot_slot, m.host_slot)}, want {(slot, host)}")
        expect(m.node.depth == depth and (m.node.snapshot_slot, m.node.host_slot) == (slot, host),
               "match-node", m.node)
        expect(m.path_len == self.ref.path_len(ids), "match-path",
               f"{ids}: cached path {m.path_len}, want {self.ref.path_len(ids)}")
        self.cache.restore(m, self.scratch)
        expect(holds_state(self._dev(), self.scratch, tuple(ids[:depth])), "restore",
               f"restore of {depth} tokens (slot {slot}, host slot {host}) gave another state")
        self.battery()
        return m

    @_op
    def admit(self, ids: list[int], snapshot_mask: int = -1,
              last_only: bool = False) -> int | None:
        """Match, lock, and take pages and slots for the rest of `ids` (evicting if short);
        snapshot at the grid points past the match selected by `snapshot_mask`'s bits (of
        those, only the deepest with `last_only`)."""
        m = self.match(ids)
        self.cache.lock(m.node)
        self.ref.locks[tuple(ids[:m.cached_len])] += 1
        aligned = len(ids) - len(ids) % self.ps
        grid_points = range(m.cached_len + self.step - m.cached_len % self.step, aligned + 1,
                            self.step)
        depths = [d for i, d in enumerate(grid_points) if snapshot_mask >> i & 1]
        depths = depths[-1:] if last_only else depths
        n_pages = (aligned - m.cached_len) // self.ps
        short_pages, short_slots = n_pages - self.page_pool.num_free, \
            len(depths) - self.state_pool.num_free
        if short_pages > 0 or short_slots > 0:
            self.evict(max(short_pages, 0), max(short_slots, 0))
        if not (self.page_pool.can_allocate(n_pages)
                and self.state_pool.can_allocate(len(depths))):
            self._unlock(ids, m)
            self.battery()
            return None
        rid = next(self._rids)
        slots = {d: self.state_pool.allocate() for d in depths}
        for d, slot in slots.items():  # what prefill would leave there
            write_state(self._dev(), slot, tuple(ids[:d]))
        self.requests[rid] = Request(ids[:aligned], m, self.page_pool.allocate(n_pages), slots)
        self.battery()
        return rid

    def _unlock(self, ids: list[int], m: PrefixMatch) -> None:
        self.cache.unlock(m.node)
        self.ref.locks[tuple(ids[:m.cached_len])] -= 1

    @_op
    def finish(self, rid: int) -> None:
        """Insert the request's ids, pages and snapshots; free what the cache did not take."""
        req = self.requests.pop(rid)
        self.now += 1
        pages = list(req.match.pages) + req.own_pages
        result = self.cache.insert(req.ids, pages, dict(req.own_slots))
        freed, unused = self.ref.insert(req.ids, pages, req.own_slots, self.now)
        expect(list(result.freed_pages) == freed, "insert-freed",
               f"got {result.freed_pages}, want {freed}")
        expect(list(result.unused_slots) == unused, "insert-unused",
               f"got {result.unused_slots}, want {unused}")
        self.page_pool.free(result.freed_pages)
        for slot in result.unused_slots:
            self.state_pool.free(slot)
        self._unlock(req.ids, req.match)
        self.battery()

    @_op
    def fork(self, ids: list[int], depth: int, host: bool = False) -> bool | None:
        """Attach a snapshot of ids[:depth] (depth on the grid, <= len(ids)) on the cached
        path; the slot comes back to the session's pool when the tree does not take it.
        None: no slot to be had on that tier (after evicting one device slot)."""
        assert 0 < depth <= len(ids) and depth % self.step == 0, depth
        if host:
            if self.bank is None or not self.bank.can_allocate(1):
                return None
            slot, pool, tensors = self.bank.allocate(), self.bank, self._host()
        else:
            if not self.state_pool.can_allocate(1):
                self.evict(n_slots=1)
            if not self.state_pool.can_allocate(1):
                return None
            slot, pool, tensors = self.state_pool.allocate(), self.state_pool, self._dev()
        write_state(tensors, slot, tuple(ids[:depth]))  # what the live slot held there
        self.now += 1
        got = self.cache.attach(ids, depth, slot, host=host)
        want = self.ref.attach(ids, depth, slot, host, self.now)
        expect(got == want, "attach", f"attach of {depth} of {ids}: got {got}, want {want}")
        if not got:
            pool.free(slot)
        self.battery()
        return got

    @_op
    def abort(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.page_pool.free(req.own_pages)
        for slot in req.own_slots.values():
            self.state_pool.free(slot)
        self._unlock(req.ids, req.match)
        self.battery()

    @_op
    def evict(self, n_pages: int = 0, n_slots: int = 0, flush: bool = False) -> None:
        ref = self.ref
        bank_free = self.bank.num_free if self.bank is not None else 0
        before = (self.page_pool.num_free, self.state_pool.num_free, bank_free)
        evictable_before = ref.evictable()
        plan = ref.plan_slot_eviction(n_slots) if n_pages == 0 and not flush else None
        result = self.cache.flush() if flush else self.cache.evict(n_pages, n_slots)
        after = read_tree(self.cache)
        moved = set(after.host) - set(ref.host)
        expect(all(ref.page.get(p) == page for p, page in after.page.items())
               and all(ref.snap.get(p) == s for p, s in after.snap.items())
               and all(ref.host.get(p) == s for p, s in after.host.items() if p not in moved)
               and moved <= set(ref.snap) - set(after.snap),
               "evict-contents", "eviction added or changed entries")
        gone = set(ref.page) - set(after.page)
        gone_dev = set(ref.snap) - set(after.snap)  # moved or dropped
        dropped = (gone_dev - moved) | (set(ref.host) - set(after.host))
        expect(not any(ref.locked(p) for p in gone | gone_dev | dropped), "locked-evicted",
               sorted(p for p in gone | gone_dev | dropped if ref.locked(p)))
        expect(all(q in gone for p in gone for q in ref.page if q[:len(p)] == p),
               "evict-shape", "a prefix was evicted but an extension of it stayed")
        host_gone = set(ref.host) - set(after.host)
        # a snapshot moved and dropped again in one call counts in n_moved and n_host_slots
        counts = (len(gone), len(gone_dev), len(moved) - len(host_gone))
        expect((result.n_pages, result.n_slots, result.n_moved - result.n_host_slots) == counts
               and result.n_moved >= len(moved), "evict-count",
               f"reported {tuple(result)}, removed {counts}")
        bank_free = self.bank.num_free if self.bank is not None else 0
        gained = (self.page_pool.num_free - before[0], self.state_pool.num_free - before[1],
                  bank_free - before[2])
        want = (result.n_pages, result.n_slots, result.n_host_slots - result.n_moved)
        expect(gained == want, "leak", f"evict reported {tuple(result)}, pools gained {gained}")
        if not flush and n_pages == n_slots == 0:
            expect(not gone and not gone_dev and not dropped, "evict-excess", "evict(0, 0)")
        if flush or n_slots == 0:  # only leaves go, with their snapshots; nothing moves
            expect(not moved and dropped <= gone, "evict-shape", "page eviction moved or "
                   "dropped an inner snapshot")
        if n_slots == 0 and not flush:  # leaves, oldest first: never newer than what stays
            keep = [p for p in after.page if not ref.locked(p)]
            expect(max((ref.time[p] for p in gone), default=0)
                   <= min((ref.time[p] for p in keep), default=float("inf")),
                   "evict-lru", "a page newer than a remaining unlocked page was evicted")
        if plan is not None:  # device slots only: exactly the predicted snapshots move/drop
            want_moved, want_dropped, want_host, bounced = plan
            expect(gone_dev == want_moved | want_dropped, "evict-lru",
                   f"device snapshots evicted {sorted(gone_dev)}, want "
                   f"{sorted(want_moved | want_dropped)}")
            expect((moved, dropped) == (want_moved, want_dropped | want_host), "host-policy",
                   f"moved {sorted(moved)} dropped {sorted(dropped)}; want moved "
                   f"{sorted(want_moved)} dropped {sorted(want_dropped | want_host)}")
            expect(all(any(s[:len(p)] == p for s in dropped) for p in gone), "evict-shape",
                   "slot eviction removed pages without a dropped snapshot")
            expect(result.n_slots == min(n_slots, evictable_before[1]), "evict-excess",
                   f"evict(n_slots={n_slots}) freed {result.n_slots} slots")
            expect(result.n_moved == len(moved) + bounced, "evict-count",
                   f"reported {result.n_moved} moves, want {len(moved)} + {bounced}")
        ref.drop(gone, gone_dev, dropped - gone_dev)
        ref.host.update({p: after.host[p] for p in moved})
        left = ref.evictable()
        expect(result.n_pages >= n_pages or left[0] == 0, "evict-short", (result, left))
        expect(result.n_slots >= n_slots or left[1] == 0, "evict-short", (result, left))
        if flush:
            expect(left == (0, 0) and all(ref.locked(p) for p in ref.host), "evict-short",
                   f"flush left {left} evictable")
        self.battery()

    @_op
    def drain(self) -> None:
        """Abort every request and flush: then every page and slot must be free."""
        for rid in list(self.requests):
            self.abort(rid)
        self.evict(flush=True)
        expect(self.page_pool.num_free == self.page_pool.num_pages - 1, "leak",
               f"{self.page_pool.num_pages - 1 - self.page_pool.num_free} pages never freed")
        in_use = self.state_pool.num_slots - 2 - self.state_pool.num_free  # padding, scratch
        expect(in_use == 0, "leak", f"{in_use} slots never freed")
        expect(self.bank is None or self.bank.num_free == self.bank.num_slots, "leak",
               "host slots never freed")
        expect(tuple(self.cache.stats()) == (0, 0, 0, 0, 0), "stats", self.cache.stats())

    # ---- the integrity battery ----------------------------------------------------------
    def battery(self) -> None:
        try:
            self.cache.check_integrity()
        except AssertionError as e:
            raise Mismatch("integrity", str(e)) from e
        got, ref = read_tree(self.cache), self.ref
        expect(got.page == ref.page, "contents", "cached pages differ from the reference")
        expect(got.snap == ref.snap, "contents", "snapshots differ from the reference")
        expect(got.host == ref.host, "contents", "host snapshots differ from the reference")
        expect(got.time == ref.time, "lru-time", "last-access times differ")
        expect(got.locked == {p for p in ref.page if ref.locked(p)}, "lock", "locked set")
        evictable = (self.cache.evictable_pages(), self.cache.evictable_slots())
        expect(evictable == ref.evictable(), "evictable", (evictable, ref.evictable()))
        stats = self.cache.stats()
        expect((stats.n_pages, stats.n_snapshots, stats.n_host_snapshots)
               == (len(ref.page), len(ref.snap), len(ref.host)), "stats")
        usage = self.cache.host_usage()
        expect(usage.n_used == len(ref.host) and usage.bytes_used == len(ref.host) * (
            self.state_pool.bytes_per_slot), "stats", usage)
        self._ledger(Counter(got.page.values()),
                     [r.own_pages for r in self.requests.values()],
                     self.page_pool.is_allocated, range(1, self.page_pool.num_pages), "page")
        self._ledger(Counter(got.snap.values()),
                     [list(r.own_slots.values()) for r in self.requests.values()]
                     + [[self.scratch]],
                     self.state_pool.is_allocated, range(1, self.state_pool.num_slots), "slot")
        if self.bank is not None:
            self._ledger(Counter(got.host.values()), [], self.bank.is_allocated,
                         range(self.bank.num_slots), "host slot")
        self._contents(got)
        for req in self.requests.values():  # what a running request borrowed is still cached
            n, m, p = req.match.cached_len, req.match, tuple(req.ids[:req.match.cached_len])
            expect([got.page.get(q) for q in ref._page_prefixes(req.ids, n)] == m.pages
                   and (n == 0 or (got.snap.get(p), got.host.get(p)) == (m.snapshot_slot,
                                                                         m.host_slot)),
                   "locked-evicted", f"a running request's prefix of {n} changed")

    def _contents(self, got) -> None:
        """Every snapshot, either tier, holds the state of its prefix, and restores to it;
        every request's own snapshot slots still hold theirs."""
        for tier, slots, tensors in (("device", got.snap, self._dev),
                                     ("host", got.host, self._host)):
            for p, slot in slots.items():
                expect(holds_state(tensors(), slot, p), "snapshot-content",
                       f"{tier} slot {slot} does not hold the state after {len(p)} tokens")
        for node in self.cache.tree.nodes():
            if node.has_snapshot:
                m = PrefixMatch(node, node.depth, [], node.snapshot_slot, node.host_slot)
                self.cache.restore(m, self.scratch)
                p = tuple(self.cache.tree.path_keys(node))
                expect(holds_state(self._dev(), self.scratch, p), "restore",
                       f"restore of {node} gave another state")
        for req in self.requests.values():
            for d, slot in req.own_slots.items():
                expect(holds_state(self._dev(), slot, tuple(req.ids[:d])), "snapshot-content",
                       f"request slot {slot} (depth {d}) was overwritten")

    def _ledger(self, owners: Counter[int], held: list[list[int]], is_allocated,
                ids: range, what: str) -> None:
        """Every allocated id has exactly one owner: the tree, one request or the session."""
        for owned in held:
            owners.update(owned)
        twice = [i for i, n in owners.items() if n > 1]
        expect(not twice, "double-owner", f"{what}s owned twice: {twice}")
        allocated = {i for i in ids if is_allocated(i)}
        expect(set(owners) <= allocated, "ownership", f"owned {what}s free in the pool: "
               f"{set(owners) - allocated}")
        expect(allocated <= set(owners), "leak", f"allocated {what}s nobody owns: "
               f"{allocated - set(owners)}")
