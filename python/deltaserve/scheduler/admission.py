"""Admission: the memory rule of the scheduler (scheduler.py's module docstring), page sizing,
and which waiting request joins the running batch next.

`Admission` is the part of `Scheduler` that decides admission; it reads the scheduler's state
(cfg, the pools, the prefix cache, snapshots, waiting and running) and is not used alone.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltaserve.cache.page_pool import PagePool
    from deltaserve.cache.prefix_cache import PrefixCache, PrefixMatch
    from deltaserve.cache.state_pool import GDNStatePool
    from deltaserve.config import EngineConfig
    from deltaserve.core import Req
    from deltaserve.scheduler.snapshots import PrefillSnapshots


class Admission:
    """Sizing and admission of `Scheduler` (its base class)."""

    cfg: EngineConfig
    page_pool: PagePool
    state_pool: GDNStatePool
    cache: PrefixCache
    snaps: PrefillSnapshots
    page_size: int
    extra_rows: int
    waiting: deque[Req]
    running: list[Req]
    hit_tokens: int
    prompt_tokens: int
    _passed: tuple[int, int]
    _no_fit: tuple[int, ...] | None

    # ---- sizing -------------------------------------------------------------------------
    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def pages_needed(self, req: Req) -> int:
        """Pages covering every position `req` may write (max_len plus the verify rows)."""
        return self.pages_for(req.max_len + self.extra_rows)

    def max_request_len(self) -> int:
        """The longest request (prompt + output tokens) the page pool can ever hold."""
        return (self.page_pool.num_pages - 1) * self.page_size - self.extra_rows

    def pool_hint(self) -> str:
        """What enlarges the KV page pool, as the user sized it."""
        return self.cfg.kv_pool_hint()

    def check_fits(self, req: Req) -> None:
        """Raise ValueError when `req` could never be admitted, even with an empty cache."""
        usable = self.page_pool.num_pages - 1
        rows = (f" + {self.extra_rows} speculative verify rows" if self.extra_rows else "")
        # first word of each message: the request field to blame (the server's param); when the
        # prompt and one output token already overflow, no max_tokens could help
        least = self.pages_for(req.prompt_len + 1 + self.extra_rows)
        if least > usable:
            raise ValueError(
                f"prompt of {req.prompt_len} tokens does not fit the KV pool: with one output "
                f"token{rows} it needs {least} KV pages of {self.page_size} tokens but the pool "
                f"has {usable}; shorten the prompt or {self.pool_hint()}")
        if self.pages_needed(req) > usable:
            raise ValueError(
                f"max_tokens {req.params.max_tokens} does not fit the KV pool: the request "
                f"needs {self.pages_needed(req)} KV pages of {self.page_size} tokens "
                f"(prompt {req.prompt_len} + max_tokens {req.params.max_tokens}{rows}) but the "
                f"pool has {usable}; lower max_tokens or {self.pool_hint()}")

    def reserved_pages(self) -> int:
        return sum(max(0, self.pages_needed(r) - len(r.page_table)) for r in self.running)

    def free_pages(self) -> int:
        """Pages a newly admitted request may take: free + evictable - reserved."""
        return self.page_pool.num_free + self.cache.evictable_pages() - self.reserved_pages()

    # ---- admission ----------------------------------------------------------------------
    def admit(self) -> None:
        """Admit waiting requests in FIFO order while they fit (the memory rule above): each
        takes its live slot (restored from its prefix match, else zeroed), its track slots and
        its matched pages, and joins `running` in prefill. When the oldest does not fit, the
        first younger one that does is admitted past it, at most max_running_reqs times while
        it waits (then the queue waits for it: never starved), so n = 128 samples of 32,000
        tokens no longer hold a 16-token request behind them. Safe while an overlapped decode step
        is in flight: slots and pages it writes are only ever handed out after their owner's
        release, and every device write of a new owner is enqueued after that step."""
        while self.waiting and len(self.running) < self.cfg.max_running_reqs:
            at, plan = 0, self._plan(self.waiting[0])
            if plan is None:
                at, plan = self._younger_that_fits()
                if plan is None:
                    return
            req = self.waiting[at]
            match, depths = plan
            cached_len = match.cached_len if match else 0
            del self.waiting[at]
            live = self.snaps.take_slot()  # may evict, but never the locked match
            if match:  # from a device slot or the host bank; zeros on a miss
                self.cache.restore(match, live)
            else:
                self.state_pool.zero(live)
            self.snaps.reserve(req, depths)
            req.admit(cached_len, live, list(match.pages) if match else [],
                      match.node if match else None)
            self.snaps.plan_fork(req, match.path_len if match else 0)
            self.hit_tokens += cached_len
            self.prompt_tokens += req.prompt_len
            self.running.append(req)

    def _younger_that_fits(self) -> tuple[int, tuple[PrefixMatch | None, list[int]] | None]:
        """(index, plan) of the first waiting request after the oldest that fits now, counted
        as one pass of the oldest; (0, None) when none does or it was passed enough."""
        rid, passed = self._passed
        if rid != self.waiting[0].rid:
            rid, passed = self.waiting[0].rid, 0
        if passed >= self.cfg.max_running_reqs:
            return 0, None
        # a request needs at least its pages past a fully cached prompt: skip the rest cheaply
        free = self.free_pages()
        # a decode step's pages come out of the reserve, so `free` moves only with admission,
        # release and the cache: while nothing moved, the last scan's answer stands
        state = (rid, self.waiting[-1].rid, len(self.waiting), len(self.running), free,
                 self.state_pool.num_free)
        if state == self._no_fit:
            return 0, None
        tries = 8  # full plans (prefix matches) a call may make
        for at in range(1, len(self.waiting)):
            req = self.waiting[at]
            if self.pages_needed(req) - self.pages_for(req.prompt_len) > free:
                continue
            plan = self._plan(req)
            if plan is not None:
                self._passed = (rid, passed + 1)
                return at, plan
            tries -= 1
            if not tries:
                break
        self._no_fit = state
        return 0, None

    def _plan(self, req: Req) -> tuple[PrefixMatch | None, list[int]] | None:
        """The prefix match `req` resumes from (locked) and the track depths to reserve, or
        None when it must wait for running requests to free memory (its pages or a live
        slot).

        Track snapshots never make a request wait (snapshots.py): it reserves the slots left
        beside a live slot for each request that could still join the batch, deepest first.
        With nothing running and no slot at all, the locked match's path holds every slot
        there is: the match is given up (unlocked, its snapshots become evictable; check_fits
        guarantees the pages of a cold start).
        """
        match = self.cache.match(req.prompt_ids) if self.cfg.enable_prefix_cache else None
        if match:
            self.cache.lock(match.node)
        depths = self.snaps.track_depths(req.prompt_len, match.cached_len if match else 0)
        need_pages = self.pages_needed(req) - len(match.pages if match else [])
        avail_pages = self.free_pages()  # after the lock: the match's pages are not evictable
        avail_slots = self.snaps.available_slots()
        if need_pages <= avail_pages and avail_slots >= 1:
            others = max(0, self.cfg.max_running_reqs - len(self.running) - 1)
            spare = min(len(depths), max(0, avail_slots - 1 - others))
            return match, depths[len(depths) - spare:]
        if match:
            self.cache.unlock(match.node)
        if self.running or need_pages > avail_pages:
            return None
        return None, []

    def ensure_pages(self, req: Req, n_tokens: int) -> None:
        """Give `req` the pages covering positions [0, n_tokens) (free ones, else evicted
        from the prefix cache); within what admission reserved for it."""
        need = self.pages_for(n_tokens) - len(req.page_table)
        if need <= 0:
            return
        short = need - self.page_pool.num_free
        if short > 0:
            self.cache.evict(n_pages=short)
        req.page_table.extend(self.page_pool.allocate(need))
