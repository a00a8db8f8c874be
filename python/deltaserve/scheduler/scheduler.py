"""Continuous-batching scheduler: admission, chunked prefill, decode, commit, finish.

Memory rule: a request is admitted only when the pages it may still need (up to `max_len`
plus the extra rows of a verify step) fit in free + evictable pages minus what running
requests have reserved, and its slots are taken at admission. So a running request never
waits for memory and nothing is preempted; requests that cannot fit wait in FIFO order, except
that younger ones that fit may pass the oldest, at most max_running_reqs times while it waits
(`admit`).

Snapshots (snapshots.py): the state at the prompt's last grid boundary B (a multiple of
G = lcm(snapshot_grid, page_size), B <= prompt_len) goes to a track slot reserved at admission
(written by the forward whose chunk runs past B, or copied when a chunk ends there); every
intermediate prefill chunk ends on the grid and its end is copied to a snapshot slot taken
then, when one can be had. All of them enter the prefix
cache when the request finishes. A finished request whose processed length is on the grid
gives its live slot to the cache as one more snapshot, unless an overlapped decode step
(engine/overlap.py) already advanced that slot past its last token (`Req.ahead`). A prompt
that leaves a cached path past that path's last snapshot also ends a chunk at the deepest grid
boundary on the shared part (a fork snapshot, given to the tree at once: see snapshots.py).

Speculation: decode and verify steps take no snapshot. A verify step runs k+1 rows and replays
only the accepted ones into the live state, so the state at a grid boundary crossed inside the
step never exists on its own: that boundary is skipped (a later prompt resumes from an earlier
snapshot). Plain decode skips them too, for the same rule everywhere. Only at release, when
device_len is on the grid, is the live slot cached (release settles the verify rows still
pending in the state pool first, so the snapshot is exact).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltaserve.core import Batch, FinishReason, Phase, Req, ReqStatus
from deltaserve.scheduler.admission import Admission
from deltaserve.scheduler.snapshots import PrefillSnapshots

if TYPE_CHECKING:
    from deltaserve.cache.page_pool import PagePool
    from deltaserve.cache.prefix_cache import PrefixCache
    from deltaserve.cache.state_pool import GDNStatePool
    from deltaserve.config import EngineConfig


class Scheduler(Admission):
    """Owns the waiting queue, the running set and every request's pages and slots (sizing and
    admission: admission.py)."""

    def __init__(self, cfg: EngineConfig, page_pool: PagePool, state_pool: GDNStatePool,
                 cache: PrefixCache, eos_ids: set[int],
                 on_release: Callable[[Req], None] | None = None,
                 choose_drafts: Callable[[list[Req]], int] | None = None) -> None:
        """choose_drafts(decoding requests) -> drafts per request for the next decode step:
        0 (a plain decode batch) or decode_rows_per_req - 1 (a verify batch); None: always
        the latter (spec/policy.py says why there is nothing in between)."""
        self.cfg = cfg
        self.choose_drafts = choose_drafts
        self.page_pool, self.state_pool, self.cache = page_pool, state_pool, cache
        self.page_size = cfg.page_size
        self.grid = math.lcm(cfg.snapshot_grid, cfg.page_size)
        self.extra_rows = cfg.decode_rows_per_req - 1
        self.eos_ids = eos_ids
        self.on_release = on_release
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.snaps = PrefillSnapshots(state_pool, cache, self.grid, cfg.max_prompt_snapshots,
                                      enabled=cfg.enable_prefix_cache,
                                      forks=cfg.fork_snapshots)
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self._prefill_turn = False  # the last batch was a prefill batch
        self._passed: tuple[int, int] = (-1, 0)  # (rid of the oldest waiting, times passed)
        self._no_fit: tuple[int, ...] | None = None  # admission.py: the last fruitless scan

    # ---- queue --------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def abort(self, rid: int) -> Req | None:
        """Finish request `rid` with ABORT and free everything it holds."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish(FinishReason.ABORT)
                return req
        for req in self.running:
            if req.rid == rid:
                req.finish(FinishReason.ABORT)
                self.release(req)
                return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- batches ------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Admit what fits, then return a prefill batch of the unfinished prompts or a decode
        batch of every request past its prompt (a verify batch of k+1 rows per request when
        decode_rows_per_req > 1; each request widened by k pending rows); None when idle.
        While both kinds run they take turns, so a long prompt read in chunk by chunk delays
        the decoding requests' next token by one prefill batch, not by the whole prompt (a
        32k-token prompt stalled every stream for 26 s on CPU when prefill always came first).
        Raises RuntimeError when requests wait and none runs after admission (nothing would
        ever free memory for them: a bug, reported instead of spinning for ever)."""
        self.admit()
        if self.waiting and not self.running:
            raise RuntimeError(
                f"admission stalled: {len(self.waiting)} waiting, none running; pages free "
                f"{self.page_pool.num_free} + evictable {self.cache.evictable_pages()}, slots "
                f"free {self.state_pool.num_free} + evictable {self.cache.evictable_slots()}")
        prefill = [r for r in self.running if r.in_prefill]
        decoding = [r for r in self.running if not r.in_prefill]
        if prefill and not (decoding and self._prefill_turn):
            self._prefill_turn = True
            reqs, lens, tracks, budget = [], [], [], self.cfg.max_num_batched_tokens
            for req in prefill:
                if budget <= 0:
                    break
                n = self.snaps.chunk_len(
                    req, req.schedule_chunk(min(self.cfg.chunk_size, budget)))
                self.ensure_pages(req, req.device_len + n)
                reqs.append(req)
                lens.append(n)
                tracks.append(self.snaps.interior_track(req, n))  # written by the forward
                budget -= n
            return Batch(Phase.PREFILL, reqs, lens,
                         tracks=tracks if any(t is not None for t in tracks) else None)
        self._prefill_turn = False
        if not decoding:
            return None
        rows = self.cfg.decode_rows_per_req
        if self.choose_drafts is not None and rows > 1:
            rows = 1 + self.choose_drafts(decoding)
            assert rows in (1, self.cfg.decode_rows_per_req), rows
        for req in decoding:
            self.ensure_pages(req, req.device_len + rows)
            if rows > 1:
                req.widen_pending(rows - 1)
        phase = Phase.VERIFY if rows > 1 else Phase.DECODE
        return Batch(phase, decoding, [rows] * len(decoding), rows_per_req=rows)

    # ---- results ------------------------------------------------------------------------
    def process(self, batch: Batch, sampled: dict[int, list[int]],
                commit_rows: Callable[[list[int]], None] | None = None) -> list[Req]:
        """Advance each request of `batch` past its rows and commit its sampled tokens.

        `sampled[rid]` holds the tokens to commit (empty for a prefill chunk that does not end
        the prompt). For a verify batch `commit_rows(counts)` is called with the number of rows
        each request keeps (its committed tokens) before anything is released, so those rows
        are committed (GDN rows pending in the pool, settled at the latest by release) while
        the request still owns its slot. Returns the requests that finished in this step
        (already released).
        """
        if batch.phase is Phase.VERIFY:
            return self._process_verify(batch, sampled, commit_rows)
        finished = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.finished:  # aborted while the step ran
                continue
            req.complete_step(n)
            if batch.phase is Phase.PREFILL:
                self.snaps.after_chunk(req)
            tokens = sampled.get(req.rid, [])
            if tokens:
                self._commit_tokens(req, tokens)
            if req.finished:
                self.release(req)
                finished.append(req)
        return finished

    def _process_verify(self, batch: Batch, sampled: dict[int, list[int]],
                        commit_rows: Callable[[list[int]], None] | None) -> list[Req]:
        counts = [0 if req.finished else self._commit_tokens(req, sampled[req.rid])
                  for req in batch.reqs]
        assert commit_rows is not None, "a verify step needs commit_rows"
        commit_rows(counts)
        finished = []
        for req, n in zip(batch.reqs, counts):
            if n == 0:  # aborted while the step ran: already released
                continue
            req.commit_pending(n)
            if not req.ahead:  # else a verify step launched ahead still writes those pages
                self.rollback_tail(req)
            if req.finished:
                self.release(req)
                finished.append(req)
        return finished

    def rollback_tail(self, req: Req) -> None:
        """Free the pages that only hold KV of rejected verify rows (every page past the one
        holding position device_len - 1); the next step allocates what it needs again."""
        keep = self.pages_for(req.device_len)
        if len(req.page_table) > keep:
            self.page_pool.free(req.page_table[keep:])
            del req.page_table[keep:]

    def _commit_tokens(self, req: Req, tokens: list[int]) -> int:
        """Append `tokens` in order, stopping at the first that finishes `req`; returns how
        many were committed. Without stop strings the first finishing token is found from
        the stop ids and the length room at once and the tokens go in with one extend (20-25 µs
        less between a batch-32 MTP verify step's sync and its next replay, bench_step_host);
        `_commit_each` is the same rule token by token."""
        detok = req.detok
        if len(tokens) == 1 or (detok is not None and detok.watches_stops) \
                or req.healing_pending():  # a budget that grows while healing: one by one
            return self._commit_each(req, tokens)  # a decode step's one token: as cheap
        p = req.params
        # the token that reaches max_tokens or max_len finishes by length (at least the first:
        # a running request always has room for one)
        n = max(1, min(req.output_budget() - len(req.output_ids), req.max_len - req.num_tokens))
        reason = FinishReason.LENGTH if n <= len(tokens) else None
        n = min(n, len(tokens))
        ends, stops = (() if p.ignore_eos else self.eos_ids), p.stop_token_ids
        if ends or stops:  # a stop id first (also on the token that reaches the length)
            for i in range(n):
                if tokens[i] in ends or tokens[i] in stops:
                    n, reason = i + 1, FinishReason.STOP
                    break
        req.extend_output(tokens[:n])
        if detok is not None:  # a stop id's own text is not output
            detok.extend(tokens[:n - 1] if reason is FinishReason.STOP else tokens[:n])
        if reason is not None:
            req.finish(reason)
        return n

    def _commit_each(self, req: Req, tokens: list[int]) -> int:
        """`_commit_tokens` one token at a time: a stop string is searched after each."""
        for i, token in enumerate(tokens):
            req.append_output(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                req.finish(reason)
                return i + 1
        return len(tokens)

    def _stop_reason(self, req: Req, token: int) -> FinishReason | None:
        p = req.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if req.detok is not None and req.detok.append(token):
            return FinishReason.STOP
        if len(req.output_ids) >= req.output_budget() or req.num_tokens >= req.max_len:
            return FinishReason.LENGTH
        return None

    # ---- release ------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Give `req`'s pages and slots to the prefix cache (finished normally) or back to the
        pools (aborted); unlock its matched prefix. `req` holds nothing afterwards."""
        assert req.status is ReqStatus.FINISHED
        # its live slot may stay in the prefix cache as a snapshot: complete every state now
        # (verify rows are left pending between steps, GDNStatePool.defer_replay)
        self.state_pool.settle()
        if req in self.running:
            self.running.remove(req)
        if self.on_release is not None:  # first: a proposer may finish the KV the cache keeps
            self.on_release(req)
        owned_from = req.cached_len // self.page_size  # pages before this came from the tree
        slots_left = {req.slot} | self.snaps.release(req)
        if self.cfg.enable_prefix_cache and req.finish_reason is not FinishReason.ABORT:
            n_pages = req.device_len // self.page_size
            snaps = dict(req.snapshots)
            # req.ahead > 0: an overlapped decode step already ran the live state past
            # device_len (a stop token found one step late), so it is no snapshot of it
            if req.device_len % self.grid == 0 and req.device_len > 0 and req.ahead == 0 \
                    and req.device_len not in snaps:
                snaps[req.device_len] = req.slot
            # with lookahead keys the last cached position pairs with the token after it
            n_ids = n_pages * self.page_size + (1 if self.cfg.radix_lookahead else 0)
            # host snapshots sit at chunk ends below the prompt's end: never at a depth of snaps
            result = self.cache.insert(req.tokens(0, n_ids), req.page_table[:n_pages], snaps,
                                       req.host_snapshots)
            self.page_pool.free(list(result.freed_pages) + req.page_table[n_pages:])
            slots_left -= set(snaps.values()) - set(result.unused_slots)
            host_left = set(result.unused_host_slots)
        else:
            self.page_pool.free(req.page_table[owned_from:])
            host_left = set(req.host_snapshots.values())
        for slot in sorted(host_left):
            self.cache.host_bank.free(slot)
        for slot in sorted(slots_left):
            self.state_pool.free(slot)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.slot, req.page_table, req.prefix_node, req.snapshots = None, [], None, {}
        req.host_snapshots = {}
