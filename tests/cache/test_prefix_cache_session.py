"""PrefixCache against its reference model: random sessions, then broken proxies that must fail.

Every step runs the integrity battery (see cache_session.Session); sessions run without a host
bank and with banks of 0, 2 and 3 slots. The self-tests wrap the cache (or the bank) in
deliberately broken subclasses and check that the right tag fires, both in a short scripted
session and in the randomized one.
"""

from __future__ import annotations

import random

import pytest
from cache_reference import Mismatch
from cache_session import Session
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from deltaserve.cache.host_bank import HostSnapshotBank
from deltaserve.cache.prefix_cache import PrefixCache, PrefixMatch

GRID = 4
_rng = random.Random(20261129)
STEMS = [[_rng.randrange(10) for _ in range(32)] for _ in range(3)]

# prompts that share prefixes: a cut of one of three stems plus a short random tail
ids_st = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tail,
                   st.integers(0, len(STEMS) - 1),
                   st.one_of(st.sampled_from([8, 16, 24, 32]), st.integers(0, 32)),
                   st.lists(st.integers(0, 1), max_size=8)).filter(bool)


class CacheMachine(RuleBasedStateMachine):
    cache_cls: type[PrefixCache] = PrefixCache
    bank_cls: type[HostSnapshotBank] = HostSnapshotBank

    @initialize(page_size=st.sampled_from([1, 2, 4, 8]),
                bank=st.sampled_from([None, 0, 1, 2, 3, 2, 3]))
    def start(self, page_size, bank):
        # small pools: three requests of up to 40 tokens do not fit, so admission evicts; a
        # bank of a few slots (2 and 3 drawn twice as often) fills up, so moves drop host
        # snapshots
        self.s = Session(page_size, num_pages=1 + 80 // page_size, num_slots=7, grid=GRID,
                         cache_cls=self.cache_cls, bank_slots=bank, bank_cls=self.bank_cls)

    def _admit(self, ids, mask, last_only=False):
        if len(self.s.requests) < 3:
            self.s.admit(ids, mask, last_only)

    @rule(ids=ids_st, mask=st.integers(0, 255))
    def admit(self, ids, mask):
        self._admit(ids, mask)

    @rule(ids=ids_st, kind=st.sampled_from(["none", "last", "all"]))
    def admit_usual_snapshots(self, ids, kind):  # as the scheduler takes them
        self._admit(ids, 0 if kind == "none" else -1, last_only=kind == "last")

    @rule(ids=ids_st, k=st.integers(1, 4), host=st.booleans())
    def fork(self, ids, k, host):  # a fork snapshot of a cached path, as prefill takes it
        if k * self.s.step <= len(ids):
            self.s.fork(ids, k * self.s.step, host)

    @rule(ids=ids_st, host=st.booleans())
    def fork_where_the_path_leaves(self, ids, host):  # the scheduler's depth
        depth = self.s.ref.path_len(ids) // self.s.step * self.s.step
        if depth > 0:
            self.s.fork(ids, depth, host)

    @precondition(lambda self: self.s.requests)
    @rule(pick=st.integers(0, 2))
    def finish(self, pick):
        self.s.finish(sorted(self.s.requests)[pick % len(self.s.requests)])

    @precondition(lambda self: self.s.requests)
    @rule()
    def finish_oldest(self):
        self.s.finish(min(self.s.requests))

    @precondition(lambda self: self.s.requests)
    @rule(pick=st.integers(0, 2))
    def abort(self, pick):
        self.s.abort(sorted(self.s.requests)[pick % len(self.s.requests)])

    @rule(ids=ids_st)
    def match(self, ids):
        self.s.match(ids)

    @rule(n_pages=st.integers(0, 12), n_slots=st.integers(0, 3),
          mode=st.sampled_from(["pages", "slots", "both", "pages", "slots", "both", "flush",
                                "drain"]))
    def evict(self, n_pages, n_slots, mode):
        # LRU order is checked per kind: pages-only and slots-only evictions
        if mode == "flush":
            self.s.evict(flush=True)
        elif mode == "drain":
            self.s.drain()
        else:
            self.s.evict(n_pages if mode != "slots" else 0, n_slots if mode != "pages" else 0)

    def teardown(self):
        if hasattr(self, "s") and not self.s.failed:  # else the first failure is the report
            self.s.drain()


SESSION_SETTINGS = settings(max_examples=300, stateful_step_count=50, derandomize=True,
                            deadline=None, database=None,
                            suppress_health_check=[HealthCheck.too_slow])


def test_random_sessions_agree_with_the_reference_model():
    run_state_machine_as_test(CacheMachine, settings=SESSION_SETTINGS)


# ---- deliberately broken proxies ----------------------------------------------------------
class LeakyEvict(PrefixCache):
    """Forgets to return evicted pages to the pool."""

    def _free_pages(self, pages):
        pass


class LRUInversion(PrefixCache):
    """Evicts the most recently used first."""

    def _priority(self, node):
        return (-node.last_access, -node.depth, node.uid)


class ShortMatch(PrefixCache):
    """Returns the snapshot before the deepest usable one."""

    def match(self, ids) -> PrefixMatch:
        m = super().match(ids)
        return super().match(ids[:m.cached_len]) if m.cached_len else m


class ShortPath(PrefixCache):
    """Reports the cached path one page shorter than it is (fork snapshots land too high)."""

    def match(self, ids) -> PrefixMatch:
        m = super().match(ids)
        return m._replace(path_len=max(0, m.path_len - self.page_size))


class FreesTreePages(PrefixCache):
    """Returns every already-cached caller page as freed, even the tree's own."""

    def insert(self, ids, pages, snapshots=None):
        had = [p for p in pages if p in self.tree.pages]
        result = super().insert(ids, pages, snapshots)
        return result._replace(freed_pages=result.freed_pages + had[:1])


class NoLock(PrefixCache):
    """Locks nothing (and so unlocks nothing)."""

    def lock(self, node):
        pass

    def unlock(self, node):
        pass


class ForkAtTheWrongDepth(PrefixCache):
    """Attaches a fork snapshot one grid step above the depth its state belongs to."""

    def attach(self, ids, depth, slot, host=False):
        return super().attach(ids, max(self.snapshot_step, depth - self.snapshot_step), slot,
                              host)


class ForkSaysNo(PrefixCache):
    """Takes a fork snapshot but reports that it did not (the caller frees a tree slot)."""

    def attach(self, ids, depth, slot, host=False):
        super().attach(ids, depth, slot, host)
        return False


def scripted(session: Session) -> None:
    """Two branches, a re-use of one, a path cached without snapshots and forks on it (one
    refused: the node has one), evictions of both kinds, a flush."""
    a, b = STEMS[0][:24], STEMS[0][:8] + STEMS[1][:16]
    session.finish(session.admit(a))
    session.finish(session.admit(b))
    session.finish(session.admit(a + [1]))  # reuses a's pages up to its deepest snapshot
    session.match(a + [5])
    c = STEMS[2][:24]
    session.finish(session.admit(c, snapshot_mask=0))  # KV only: no resumable depth
    assert session.fork(c + [1], 2 * session.step)  # inside the edge: split there
    assert session.fork(c, 2 * session.step) is False  # already has one
    assert session.fork(STEMS[1][:24], session.step) is False  # not cached
    session.match(c[:2 * session.step] + [7])  # resumes at the fork
    session.evict(n_pages=4)
    session.evict(n_slots=1)
    session.evict(flush=True)
    session.drain()


def test_the_scripted_session_passes_on_the_real_cache():
    for page_size in (1, 2, 4, 8):
        scripted(Session(page_size, 1 + 96 // page_size, 12, GRID))


BROKEN = [(LeakyEvict, "leak"), (LRUInversion, "evict-lru"), (ShortMatch, "match-depth"),
          (ShortPath, "match-path"),
          (FreesTreePages, "insert-freed"), (NoLock, "lock"), (ForkSaysNo, "attach")]
# in a random session the wrong depth may be refused where the right one is not: "attach"
SCRIPTED_BROKEN = [*BROKEN, (ForkAtTheWrongDepth, "contents")]


@pytest.mark.parametrize(("cache_cls", "tag"), SCRIPTED_BROKEN,
                         ids=[c.__name__ for c, _ in SCRIPTED_BROKEN])
def test_a_broken_cache_fails_the_scripted_session_under_its_tag(cache_cls, tag):
    with pytest.raises(Mismatch) as failure:
        scripted(Session(4, 1 + 96 // 4, 12, GRID, cache_cls=cache_cls))
    assert failure.value.tag == tag, str(failure.value)


@pytest.mark.parametrize(("cache_cls", "tag"), BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_a_broken_cache_fails_the_random_session_under_its_tag(cache_cls, tag):
    machine = type(f"{cache_cls.__name__}Machine", (CacheMachine,), {"cache_cls": cache_cls})
    quick = settings(SESSION_SETTINGS, phases=[Phase.generate])
    with pytest.raises(Mismatch) as failure:
        run_state_machine_as_test(machine, settings=quick)
    assert failure.value.tag == tag, str(failure.value)


# ---- the host tier: a scripted session and broken proxies -----------------------------------
class WrongSlotStore(HostSnapshotBank):
    """Stores another allocated device slot than the one asked for."""

    def store(self, pool, dev_slot, host_slot):
        other = next(s for s in range(1, pool.num_slots) if s != dev_slot and pool.is_allocated(s))
        super().store(pool, other, host_slot)


class HostLRUInversion(PrefixCache):
    """A full bank gives up its most recently used snapshot first."""

    def _host_key(self, node):
        t, *rest = super()._host_key(node)
        return (-t, *rest)


class LeakyHostDrop(PrefixCache):
    """Forgets to return a dropped host snapshot to the bank, unless the bank is full (where
    the move that follows would trip the bank's own assertion instead)."""

    def _free_host_slot(self, slot):
        if not self.host_bank.can_allocate(1):
            super()._free_host_slot(slot)


class RestoreIgnoresHost(PrefixCache):
    """Restores a host snapshot as the initial (zero) state."""

    def restore(self, match, dst_slot):
        if match.host_slot is None:
            super().restore(match, dst_slot)
        else:
            self.state_pool.zero(dst_slot)


def scripted_host(session: Session) -> None:
    """Two paths; moves to a bank of 2 until it is full (the incoming snapshot dropped, then
    an older host one), a restore from the bank, a leaf with a host snapshot evicted by
    pages, a flush."""
    a, b = STEMS[0][:16], STEMS[1][:16]
    session.finish(session.admit(a))
    session.finish(session.admit(b))
    session.evict(n_slots=2)  # a's deepest two move to the bank: now full
    session.evict(n_slots=2)  # a's shallower two: each is dropped itself (first in order)
    session.match(b + [1])
    session.match(a + [1])  # a host hit, restored from the bank
    session.evict(n_slots=1)  # b's deepest is older than the bank's: dropped itself
    session.match(b + [1])
    session.evict(n_slots=1)  # now b's is newer: an older host snapshot goes first
    session.evict(n_pages=1)  # a's leaf, with its host snapshot
    session.evict(flush=True)
    session.drain()


def test_the_scripted_host_session_passes_on_the_real_cache():
    for page_size in (1, 2, 4, 8):
        for bank_slots in (0, 2, 3):
            scripted_host(Session(page_size, 1 + 96 // page_size, 12, GRID,
                                  bank_slots=bank_slots))


HOST_BROKEN = [(PrefixCache, WrongSlotStore, "snapshot-content"),
               (HostLRUInversion, HostSnapshotBank, "host-policy"),
               (LeakyHostDrop, HostSnapshotBank, "leak"),
               (RestoreIgnoresHost, HostSnapshotBank, "restore")]
HOST_IDS = [c.__name__ if c is not PrefixCache else b.__name__ for c, b, _ in HOST_BROKEN]


@pytest.mark.parametrize(("cache_cls", "bank_cls", "tag"), HOST_BROKEN, ids=HOST_IDS)
def test_a_broken_host_tier_fails_the_scripted_session_under_its_tag(cache_cls, bank_cls, tag):
    with pytest.raises(Mismatch) as failure:
        scripted_host(Session(4, 1 + 96 // 4, 12, GRID, cache_cls=cache_cls, bank_slots=2,
                              bank_cls=bank_cls))
    assert failure.value.tag == tag, str(failure.value)


@pytest.mark.parametrize(("cache_cls", "bank_cls", "tag"), HOST_BROKEN, ids=HOST_IDS)
def test_a_broken_host_tier_fails_the_random_session_under_its_tag(cache_cls, bank_cls, tag):
    machine = type(f"{HOST_IDS[HOST_BROKEN.index((cache_cls, bank_cls, tag))]}Machine",
                   (CacheMachine,), {"cache_cls": cache_cls, "bank_cls": bank_cls})
    quick = settings(SESSION_SETTINGS, phases=[Phase.generate])
    with pytest.raises(Mismatch) as failure:
        run_state_machine_as_test(machine, settings=quick)
    assert failure.value.tag == tag, str(failure.value)
