"""PrefixCache against its reference model: random sessions, then broken proxies that must fail.

Every step runs the integrity battery (see cache_reference.Session). The self-tests wrap the
cache in deliberately broken subclasses and check that the right tag fires, both in a short
scripted session and in the randomized one.
"""

from __future__ import annotations

import random

import pytest
from cache_reference import Mismatch, Session
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

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

    @initialize(page_size=st.sampled_from([1, 2, 4, 8]))
    def start(self, page_size):
        # small pools: three requests of up to 40 tokens do not fit, so admission evicts
        self.s = Session(page_size, num_pages=1 + 80 // page_size, num_slots=7, grid=GRID,
                         cache_cls=self.cache_cls)

    def _admit(self, ids, mask, last_only=False):
        if len(self.s.requests) < 3:
            self.s.admit(ids, mask, last_only)

    @rule(ids=ids_st, mask=st.integers(0, 255))
    def admit(self, ids, mask):
        self._admit(ids, mask)

    @rule(ids=ids_st, kind=st.sampled_from(["none", "last", "all"]))
    def admit_usual_snapshots(self, ids, kind):  # as the scheduler takes them
        self._admit(ids, 0 if kind == "none" else -1, last_only=kind == "last")

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


def scripted(session: Session) -> None:
    """Two branches, a re-use of one, evictions of both kinds, a flush."""
    a, b = STEMS[0][:24], STEMS[0][:8] + STEMS[1][:16]
    session.finish(session.admit(a))
    session.finish(session.admit(b))
    session.finish(session.admit(a + [1]))  # reuses a's pages up to its deepest snapshot
    session.match(a + [5])
    session.evict(n_pages=4)
    session.evict(n_slots=1)
    session.evict(flush=True)
    session.drain()


def test_the_scripted_session_passes_on_the_real_cache():
    for page_size in (1, 2, 4, 8):
        scripted(Session(page_size, 1 + 96 // page_size, 12, GRID))


BROKEN = [(LeakyEvict, "leak"), (LRUInversion, "evict-lru"), (ShortMatch, "match-depth"),
          (FreesTreePages, "insert-freed"), (NoLock, "lock")]


@pytest.mark.parametrize(("cache_cls", "tag"), BROKEN, ids=[c.__name__ for c, _ in BROKEN])
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
