"""An independent reference model of PrefixCache and a session that checks the real cache.

The reference holds no tree: one entry per cached page prefix (its page id, last-access time)
and per snapshot prefix (its slot), plus the locked match prefixes. The session plays the
engine (admit = match + lock + allocate, finish = insert + unlock, abort, evict, flush),
applies every operation to both, compares each answer under a named tag and runs the
integrity battery (the cache's own checks plus an ownership ledger of every page and slot)
after every operation. A failed comparison raises Mismatch(tag).
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass, field

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache, PrefixMatch
from deltaserve.cache.state_pool import GDNStatePool

Prefix = tuple[int, ...]


class Mismatch(AssertionError):
    def __init__(self, tag: str, detail: str) -> None:
        super().__init__(f"[{tag}] {detail}")
        self.tag = tag


def expect(ok: bool, tag: str, detail: object = "") -> None:
    if not ok:
        raise Mismatch(tag, str(detail))


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
class RefCache:
    page_size: int
    page: dict[Prefix, int] = field(default_factory=dict)  # cached page prefix -> its last page
    time: dict[Prefix, float] = field(default_factory=dict)  # page prefix -> last access
    snap: dict[Prefix, int] = field(default_factory=dict)  # snapshot prefix -> slot
    locks: Counter[Prefix] = field(default_factory=Counter)  # matched prefixes held locked

    def _page_prefixes(self, ids: list[int], upto: int) -> list[Prefix]:
        return [tuple(ids[:k]) for k in range(self.page_size, upto + 1, self.page_size)]

    def match(self, ids: list[int], now: float) -> tuple[int, list[int], int | None]:
        hits = [len(p) for p in self.snap if len(p) < len(ids) and tuple(ids[:len(p)]) == p]
        depth = max(hits, default=0)
        prefixes = self._page_prefixes(ids, depth)
        for p in prefixes:
            self.time[p] = now
        return depth, [self.page[p] for p in prefixes], self.snap.get(tuple(ids[:depth]))

    def insert(self, ids: list[int], pages: list[int], snaps: dict[int, int],
               now: float) -> tuple[list[int], list[int]]:
        freed, unused = [], []
        for p, page in zip(self._page_prefixes(ids, len(ids)), pages, strict=True):
            if p not in self.page:
                self.page[p] = page
            elif self.page[p] != page:
                freed.append(page)
            self.time[p] = now
        for depth in sorted(snaps):
            p = tuple(ids[:depth])
            if p not in self.snap:
                self.snap[p] = snaps[depth]
            elif self.snap[p] != snaps[depth]:
                unused.append(snaps[depth])
        return freed, unused

    def locked(self, p: Prefix) -> bool:
        """A prefix is locked when a locked match prefix runs through (or ends at) it."""
        return any(n > 0 and len(q) >= len(p) and q[:len(p)] == p for q, n in self.locks.items())

    def evictable(self) -> tuple[int, int]:
        return (sum(not self.locked(p) for p in self.page),
                sum(not self.locked(p) for p in self.snap))

    def drop(self, pages: set[Prefix], snaps: set[Prefix]) -> None:
        for p in pages:
            del self.page[p], self.time[p]
        for p in snaps:
            del self.snap[p]


@dataclass
class Contents:
    page: dict[Prefix, int]
    time: dict[Prefix, float]
    snap: dict[Prefix, int]
    locked: set[Prefix]


def read_tree(cache: PrefixCache) -> Contents:
    """What the real cache holds, spelled out per page prefix (identity keys assumed)."""
    out = Contents({}, {}, {}, set())
    ps = cache.page_size
    stack = [(cache.tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            full = prefix + tuple(child.keys)
            for i, page in enumerate(child.pages):
                p = full[:len(prefix) + (i + 1) * ps]
                out.page[p], out.time[p] = page, child.last_access
                if child.lock_count > 0:
                    out.locked.add(p)
            if child.snapshot_slot is not None:
                out.snap[full] = child.snapshot_slot
            stack.append((child, full))
    return out


@dataclass
class Request:
    ids: list[int]  # the page-aligned ids it inserts when it finishes
    match: PrefixMatch
    own_pages: list[int]
    own_slots: dict[int, int]  # snapshot depth -> slot it computed


class Session:
    """The real cache and the reference side by side; see the module docstring."""

    def __init__(self, page_size: int, num_pages: int, num_slots: int, grid: int,
                 cache_cls: type[PrefixCache] = PrefixCache) -> None:
        self.now = 0
        self.page_pool = PagePool(num_pages, page_size)
        self.state_pool = GDNStatePool(1, num_slots, 1, 1, 1, 1, 2)
        self.cache = cache_cls(self.page_pool, self.state_pool, page_size, grid=grid,
                               clock=lambda: self.now)
        self.ref = RefCache(page_size)
        self.ps, self.step = page_size, self.cache.snapshot_step
        self.requests: dict[int, Request] = {}
        self._rids = itertools.count()
        self.failed = False

    # ---- operations ---------------------------------------------------------------------
    @_op
    def match(self, ids: list[int]) -> PrefixMatch:
        self.now += 1
        m = self.cache.match(ids)
        depth, pages, slot = self.ref.match(ids, self.now)
        expect(m.cached_len == depth, "match-depth", f"{ids}: got {m.cached_len}, want {depth}")
        expect(list(m.pages) == pages, "match-pages", f"{ids}: got {m.pages}, want {pages}")
        expect(m.snapshot_slot == slot, "match-slot", f"got {m.snapshot_slot}, want {slot}")
        expect(m.node.depth == depth and m.node.snapshot_slot == slot, "match-node", m.node)
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
    def abort(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.page_pool.free(req.own_pages)
        for slot in req.own_slots.values():
            self.state_pool.free(slot)
        self._unlock(req.ids, req.match)
        self.battery()

    @_op
    def evict(self, n_pages: int = 0, n_slots: int = 0, flush: bool = False) -> None:
        ref, before = self.ref, (self.page_pool.num_free, self.state_pool.num_free)
        evictable_before = ref.evictable()
        result = self.cache.flush() if flush else self.cache.evict(n_pages, n_slots)
        after = read_tree(self.cache)
        expect(all(ref.page.get(p) == page for p, page in after.page.items())
               and all(ref.snap.get(p) == s for p, s in after.snap.items()),
               "evict-contents", "eviction added or changed entries")
        gone, gone_snaps = set(ref.page) - set(after.page), set(ref.snap) - set(after.snap)
        expect(not any(ref.locked(p) for p in gone | gone_snaps), "locked-evicted",
               sorted(p for p in gone | gone_snaps if ref.locked(p)))
        expect(all(q in gone for p in gone for q in ref.page if q[:len(p)] == p),
               "evict-shape", "a prefix was evicted but an extension of it stayed")
        expect(tuple(result) == (len(gone), len(gone_snaps)), "evict-count",
               f"reported {tuple(result)}, removed {(len(gone), len(gone_snaps))}")
        gained = (self.page_pool.num_free - before[0], self.state_pool.num_free - before[1])
        expect(gained == tuple(result), "leak", f"evict reported {tuple(result)}, pools "
               f"gained {gained}")
        if not flush and n_pages == n_slots == 0:
            expect(not gone and not gone_snaps, "evict-excess", "evict(0, 0) freed something")
        keep = [p for p in after.page if not ref.locked(p)]
        keep_snaps = [p for p in after.snap if not ref.locked(p)]
        if n_slots == 0 and not flush:  # leaves, oldest first: never newer than what stays
            expect(gone_snaps <= gone, "evict-shape", "page eviction dropped an inner snapshot")
            expect(max((ref.time[p] for p in gone), default=0)
                   <= min((ref.time[p] for p in keep), default=float("inf")),
                   "evict-lru", "a page newer than a remaining unlocked page was evicted")
        if n_pages == 0 and not flush:  # snapshots, oldest first; pages only with their leaf
            expect(all(any(s[:len(p)] == p for s in gone_snaps) for p in gone),
                   "evict-shape", "slot eviction removed pages without a snapshot")
            expect(result.n_slots == min(n_slots, evictable_before[1]), "evict-excess",
                   f"evict(n_slots={n_slots}) freed {result.n_slots} slots")
            expect(max((ref.time[p] for p in gone_snaps), default=0)
                   <= min((ref.time[p] for p in keep_snaps), default=float("inf")),
                   "evict-lru", "a snapshot newer than a remaining unlocked one was dropped")
        ref.drop(gone, gone_snaps)
        left = ref.evictable()
        expect(result.n_pages >= n_pages or left[0] == 0, "evict-short", (result, left))
        expect(result.n_slots >= n_slots or left[1] == 0, "evict-short", (result, left))
        if flush:
            expect(left == (0, 0), "evict-short", f"flush left {left} evictable")
        self.battery()

    @_op
    def drain(self) -> None:
        """Abort every request and flush: then every page and slot must be free."""
        for rid in list(self.requests):
            self.abort(rid)
        self.evict(flush=True)
        expect(self.page_pool.num_free == self.page_pool.num_pages - 1, "leak",
               f"{self.page_pool.num_pages - 1 - self.page_pool.num_free} pages never freed")
        expect(self.state_pool.num_free == self.state_pool.num_slots - 1, "leak",
               f"{self.state_pool.num_slots - 1 - self.state_pool.num_free} slots never freed")
        expect(tuple(self.cache.stats()) == (0, 0, 0, 0), "stats", self.cache.stats())

    # ---- the integrity battery ----------------------------------------------------------
    def battery(self) -> None:
        try:
            self.cache.check_integrity()
        except AssertionError as e:
            raise Mismatch("integrity", str(e)) from e
        got, ref = read_tree(self.cache), self.ref
        expect(got.page == ref.page, "contents", "cached pages differ from the reference")
        expect(got.snap == ref.snap, "contents", "snapshots differ from the reference")
        expect(got.time == ref.time, "lru-time", "last-access times differ")
        expect(got.locked == {p for p in ref.page if ref.locked(p)}, "lock", "locked set")
        evictable = (self.cache.evictable_pages(), self.cache.evictable_slots())
        expect(evictable == ref.evictable(), "evictable", (evictable, ref.evictable()))
        stats = self.cache.stats()
        expect((stats.n_pages, stats.n_snapshots) == (len(ref.page), len(ref.snap)), "stats")
        self._ledger(Counter(got.page.values()),
                     [r.own_pages for r in self.requests.values()],
                     self.page_pool.is_allocated, self.page_pool.num_pages, "page")
        self._ledger(Counter(got.snap.values()),
                     [list(r.own_slots.values()) for r in self.requests.values()],
                     self.state_pool.is_allocated, self.state_pool.num_slots, "slot")
        for req in self.requests.values():  # what a running request borrowed is still cached
            n = req.match.cached_len
            expect([got.page.get(p) for p in ref._page_prefixes(req.ids, n)] == req.match.pages
                   and (n == 0 or got.snap.get(tuple(req.ids[:n])) == req.match.snapshot_slot),
                   "locked-evicted", f"a running request's prefix of {n} changed")

    def _ledger(self, owners: Counter[int], held: list[list[int]], is_allocated,
                total: int, what: str) -> None:
        """Every allocated id has exactly one owner: the tree or one request."""
        for ids in held:
            owners.update(ids)
        twice = [i for i, n in owners.items() if n > 1]
        expect(not twice, "double-owner", f"{what}s owned twice: {twice}")
        allocated = {i for i in range(1, total) if is_allocated(i)}
        expect(set(owners) <= allocated, "ownership", f"owned {what}s free in the pool: "
               f"{set(owners) - allocated}")
        expect(allocated <= set(owners), "leak", f"allocated {what}s nobody owns: "
               f"{allocated - set(owners)}")
