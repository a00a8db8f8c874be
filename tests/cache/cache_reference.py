"""An independent reference model of PrefixCache, and what the real cache holds, spelled out.

The reference holds no tree: one entry per cached page prefix (its page id, last-access time)
and per snapshot prefix (its device slot, or its host bank slot), plus the locked match
prefixes. It predicts every answer of match and insert, and which snapshots an eviction of
device slots moves to the bank or drops (brute force over all prefixes: slow and obvious).
cache_session.Session plays both side by side; a failed comparison raises Mismatch(tag).

State contents: every snapshot of a prefix p holds `prefix_state(p)` (a hash of p written into
every element), so a copy of the wrong slot, a stale slot or a lost store shows up as a value.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from deltaserve.cache.prefix_cache import PrefixCache

Prefix = tuple[int, ...]


class Mismatch(AssertionError):
    def __init__(self, tag: str, detail: str) -> None:
        super().__init__(f"[{tag}] {detail}")
        self.tag = tag


def expect(ok: bool, tag: str, detail: object = "") -> None:
    if not ok:
        raise Mismatch(tag, str(detail))


# ---- snapshot contents: a deterministic function of the token prefix ----------------------
def prefix_state(prefix: Prefix, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """The (recurrent, conv) contents standing for the GDN state after `prefix`: all zeros for
    the empty prefix (the initial state), else a prefix hash h in every element (h * 64 +
    element index: exact in fp32, distinct per element and per prefix hash)."""
    if not prefix:
        return [torch.zeros(s) for s in shapes]
    h = zlib.crc32(repr(prefix).encode()) % (1 << 17) + 1
    return [(torch.arange(s.numel(), dtype=torch.float32) + h * 64).view(s) for s in shapes]


def write_state(tensors: tuple[torch.Tensor, ...], slot: int, prefix: Prefix) -> None:
    for t, want in zip(tensors, prefix_state(prefix, [t[:, slot].shape for t in tensors]),
                       strict=True):
        t[:, slot] = want


def holds_state(tensors: tuple[torch.Tensor, ...], slot: int, prefix: Prefix) -> bool:
    wants = prefix_state(prefix, [t[:, slot].shape for t in tensors])
    return all(torch.equal(t[:, slot].float(), w) for t, w in zip(tensors, wants, strict=True))


# ---- the reference model ------------------------------------------------------------------
@dataclass
class RefCache:
    page_size: int
    bank_slots: int | None = None  # host bank size; None: no bank
    page: dict[Prefix, int] = field(default_factory=dict)  # cached page prefix -> its last page
    time: dict[Prefix, float] = field(default_factory=dict)  # page prefix -> last access
    snap: dict[Prefix, int] = field(default_factory=dict)  # device snapshot prefix -> slot
    host: dict[Prefix, int] = field(default_factory=dict)  # host snapshot prefix -> bank slot
    locks: Counter[Prefix] = field(default_factory=Counter)  # matched prefixes held locked

    def _page_prefixes(self, ids: list[int], upto: int) -> list[Prefix]:
        return [tuple(ids[:k]) for k in range(self.page_size, upto + 1, self.page_size)]

    def match(self, ids: list[int], now: float) -> tuple[int, list[int], int | None, int | None]:
        hits = [len(p) for p in (*self.snap, *self.host)
                if len(p) < len(ids) and tuple(ids[:len(p)]) == p]
        depth = max(hits, default=0)
        prefixes = self._page_prefixes(ids, depth)
        for p in prefixes:
            self.time[p] = now
        p = tuple(ids[:depth])
        return depth, [self.page[q] for q in prefixes], self.snap.get(p), self.host.get(p)

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
            if p in self.host:  # a host snapshot is kept; the device slot comes back
                unused.append(snaps[depth])
            elif p not in self.snap:
                self.snap[p] = snaps[depth]
            elif self.snap[p] != snaps[depth]:
                unused.append(snaps[depth])
        return freed, unused

    def path_len(self, ids: list[int]) -> int:
        """Tokens of ids[:len(ids) - 1] whose page prefixes are all cached (page multiple)."""
        prefixes = self._page_prefixes(ids, len(ids) - 1)
        return next((len(p) - self.page_size for p in prefixes if p not in self.page),
                    len(prefixes) * self.page_size)

    def attach(self, ids: list[int], depth: int, slot: int, host: bool, now: float) -> bool:
        """A fork snapshot of ids[:depth]: taken when every page prefix up to depth is cached
        and that prefix holds no snapshot (either tier); those page prefixes are touched."""
        prefixes, p = self._page_prefixes(ids, depth), tuple(ids[:depth])
        if not all(q in self.page for q in prefixes) or p in self.snap or p in self.host:
            return False
        for q in prefixes:
            self.time[q] = now
        (self.host if host else self.snap)[p] = slot
        return True

    def locked(self, p: Prefix) -> bool:
        """A prefix is locked when a locked match prefix runs through (or ends at) it."""
        return any(n > 0 and len(q) >= len(p) and q[:len(p)] == p for q, n in self.locks.items())

    def evictable(self) -> tuple[int, int]:
        return (sum(not self.locked(p) for p in self.page),
                sum(not self.locked(p) for p in self.snap))

    def drop(self, pages: set[Prefix], snaps: set[Prefix], host: set[Prefix]) -> None:
        for p in pages:
            del self.page[p], self.time[p]
        for p in snaps:
            del self.snap[p]
        for p in host:
            del self.host[p]

    # ---- eviction of device slots, predicted ------------------------------------------
    def drop_key(self, p: Prefix, snapshots: set[Prefix]) -> tuple:
        """A full bank gives up the lowest: least recently used; among a tie the deepest tied
        snapshot last; then the smallest gap to the snapshot above (or the root), shallower
        first. `snapshots`: every snapshot prefix still held, both tiers."""
        t = self.time[p]
        kept = not any(len(q) > len(p) and q[:len(p)] == p and self.time[q] == t
                       for q in snapshots)
        above = max((len(q) for q in snapshots if len(q) < len(p) and p[:len(q)] == q),
                    default=0)
        return (t, kept, len(p) - above, len(p))

    def plan_slot_eviction(self, n_slots: int) -> tuple[set[Prefix], set[Prefix], set[Prefix],
                                                         int]:
        """(moved to the bank, device snapshots dropped, host snapshots dropped, moved and
        then dropped in the same call) by evict(n_slots=n_slots): least recently used unlocked
        device snapshots first (deeper on a tie); each moves to the bank, which first gives up
        its lowest `drop_key` snapshot (unlocked, or the incoming one) when full. A snapshot
        moved and then dropped counts as a dropped device snapshot (it was one before).
        Nothing changes here."""
        dev, host = set(self.snap), set(self.host)
        moved, dropped, dropped_host, bounced = set(), set(), set(), 0
        for _ in range(n_slots):
            candidates = [p for p in dev if not self.locked(p)]
            if not candidates:
                break
            p = min(candidates, key=lambda q: (self.time[q], -len(q)))
            dev.remove(p)
            if self.bank_slots is not None and len(host) >= self.bank_slots:
                victims = [q for q in host if not self.locked(q)] + [p]
                victim = min(victims, key=lambda q: self.drop_key(q, dev | host | {p}))
                if victim == p:
                    dropped.add(p)
                    continue
                host.remove(victim)
                if victim in moved:  # moved in this very call: seen as a device drop
                    moved.remove(victim)
                    dropped.add(victim)
                    bounced += 1
                else:
                    dropped_host.add(victim)
            if self.bank_slots is None:
                dropped.add(p)
            else:
                moved.add(p)
                host.add(p)
        return moved, dropped, dropped_host, bounced


@dataclass
class Contents:
    page: dict[Prefix, int]
    time: dict[Prefix, float]
    snap: dict[Prefix, int]
    host: dict[Prefix, int]
    locked: set[Prefix]


def read_tree(cache: PrefixCache) -> Contents:
    """What the real cache holds, spelled out per page prefix (identity keys assumed)."""
    out = Contents({}, {}, {}, {}, set())
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
            if child.host_slot is not None:
                out.host[full] = child.host_slot
            stack.append((child, full))
    return out
