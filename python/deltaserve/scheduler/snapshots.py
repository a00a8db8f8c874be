"""Prefill snapshots: which grid depths of a prompt keep a copy of its GDN state, and the slots.

The grid is G = lcm(snapshot_grid, page_size) tokens. A snapshot at depth d is an exact copy of
the live GDN state after tokens[0:d], taken when a prefill chunk ends at d (so the live slot
holds exactly that state). Two kinds, both recorded in `req.snapshots` {depth: slot} and handed
to the prefix cache together when the request is released:

- **Track snapshots** at the prompt's last grid boundary B (and at B - G when B == prompt_len:
  a resent identical prompt recomputes its last token, so it can only resume below B). Their
  slots are reserved at admission, those that fit beside a live slot for each request that
  could still join the batch, deepest first: with the default pool (2 snapshot slots a running
  request) all of them, and a small --num-snapshot-slots never makes a request wait for them
  (waiting capped the batch at slots / 3: about 22 of 32 on the 35B-A3B config with 4 snapshot
  slots, likely why its batch-32 decode read 1,493 against 2,134 tok/s; admission._plan). A
  chunk that ends at a track depth copies the live state there; a chunk that runs past one
  (`in_forward`, the default) has the forward write the state at that depth into the track
  slot itself (Batch.tracks: the GDN backend splits the request's recurrence there, the conv
  writes the window there), so the prompt's last chunk is not cut short at B (or B - G), which
  cost a 64n-token prompt one more forward. At most one track depth lies inside a chunk.
- **Chunk snapshots** at the end of every intermediate prefill chunk. `chunk_len` makes such a
  chunk end on the grid: its end is rounded down to the deepest grid boundary inside it (a
  chunk shorter than G that holds no boundary keeps its length, so small chunks go on until
  one ends on the grid). The slot is taken at the chunk's end: a free one, else a snapshot the
  prefix cache evicts (to its host bank when it has one); with no device slot to be had, a
  free slot of the host bank, the state stored there straight from the live slot
  (`req.host_snapshots`); none on either tier: that snapshot is skipped. Device ones are
  optional: admission of another request that is short of slots takes them back
  (most-holding request, deepest first). Bounded per prompt: at most
  `max_prompt_snapshots`, kept evenly spread by taking one only `interval(prompt_len)` tokens
  or more past the request's previous snapshot (or its cached prefix); the interval is G for
  prompts of up to max_prompt_snapshots·G tokens and grows with the prompt beyond that.
- **Fork snapshots**, at most one per request, where its prompt leaves (or runs past the last
  snapshot of) a path the tree caches: a shared system prompt is cached as KV by the first
  request, but its snapshots lie in that request's own suffix. At admission, when the match
  shows the cached path running to depth p (PrefixMatch.path_len) past the snapshot it
  resumes from, the deepest grid boundary f <= p, if deeper than that snapshot, ends a prefill
  chunk (as a track depth does); there the live state is copied to a slot taken as for chunk
  snapshots and attached at once to the tree node at f (PrefixCache.attach: the tree already
  holds the KV of [0, f)), so a request admitted after that chunk resumes at f, even while
  this one still runs. If the path was evicted meanwhile, it stays with the request as a
  chunk snapshot and enters the tree at release. Only one running request claims a given
  prefix's fork. It counts against `max_prompt_snapshots` (its chunk snapshots stop one
  short); with lookahead keys p is the lookahead match depth.

Nothing touches a request's pages or its radix-tree handles before release. Decode and verify
steps take no snapshot here (see scheduler.py for the speculation rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltaserve.cache.prefix_cache import PrefixCache
    from deltaserve.cache.state_pool import GDNStatePool
    from deltaserve.core import Req


class PrefillSnapshots:
    """Owns every running request's track slots and chunk-snapshot slots until release.

    `enabled` is False without a prefix cache (then nothing is snapshot and chunks are not
    cut); `max_per_prompt` 0 turns chunk snapshots (and the rounding of chunk ends) off, and
    fork snapshots with them; `forks` False turns fork snapshots off alone.
    """

    def __init__(self, state_pool: GDNStatePool, cache: PrefixCache, grid: int,
                 max_per_prompt: int, enabled: bool, forks: bool = True,
                 in_forward: bool = True) -> None:
        assert grid >= 1 and max_per_prompt >= 0
        self.state_pool, self.cache, self.grid = state_pool, cache, grid
        self.max_per_prompt = max_per_prompt
        self.enabled = enabled
        self.in_forward = in_forward  # track depths inside a chunk are written by the forward
        self.forks_on = forks and self.chunk_snapshots_on
        self.forks: dict[int, tuple[int, tuple[int, ...]]] = {}  # rid -> (depth, claim key)
        self.claims: dict[tuple[int, ...], int] = {}  # prompt_ids[:depth + 1] -> claiming rid
        self.n_forks = 0  # fork snapshots taken (attached at once or kept till release)
        self.n_forks_skipped = 0  # fork depths reached that found no slot on either tier
        self.tracks: dict[int, dict[int, int]] = {}  # rid -> {depth: reserved track slot}
        # rid -> (request, depths of its chunk snapshots in the order they were taken)
        self.chunk: dict[int, tuple[Req, list[int]]] = {}
        self.n_taken = 0  # chunk snapshots taken (counter, for metrics and tests)
        self.n_skipped = 0  # chunk ends on the grid that found no slot
        self.n_to_host = 0  # of those taken, stored straight into the host bank

    @property
    def chunk_snapshots_on(self) -> bool:
        return self.enabled and self.max_per_prompt > 0

    # ---- depths -------------------------------------------------------------------------
    def track_depths(self, prompt_len: int, cached_len: int) -> list[int]:
        """Grid depths in (cached_len, prompt_len] whose track slots admission reserves."""
        if not self.enabled:
            return []
        last = (prompt_len // self.grid) * self.grid
        depths = [last - self.grid, last] if last == prompt_len else [last]
        return [d for d in depths if d > cached_len]

    def interval(self, prompt_len: int) -> int:
        """Least spacing in tokens between a prompt's chunk snapshots (a multiple of G)."""
        boundaries = prompt_len // self.grid
        return self.grid * max(1, -(-boundaries // max(1, self.max_per_prompt)))

    def chunk_len(self, req: Req, n: int) -> int:
        """The length of `req`'s next prefill chunk given `n` schedulable tokens (n >= 1):
        a chunk that is not the prompt's last ends on the grid when a grid boundary lies
        inside it; no chunk runs past a fork depth, nor past a reserved track depth unless
        `in_forward` (then past at most one: `interior_track`). Returns 1..n."""
        start, end = req.device_len, req.device_len + n
        if self.chunk_snapshots_on and end < req.prompt_len:
            on_grid = end // self.grid * self.grid
            if on_grid > start:
                end = on_grid
        fork = self.forks.get(req.rid)
        for depth in fork[:1] if fork else ():
            if start < depth < end:
                end = depth
        inside = sorted(d for d in self.tracks.get(req.rid, ()) if start < d < end)
        if inside and not self.in_forward:
            end = inside[0]
        elif len(inside) > 1:
            end = inside[1]
        return end - start

    def interior_track(self, req: Req, n: int) -> tuple[int, int] | None:
        """For the chunk of n rows from req.device_len (chunk_len's): (offset into the chunk,
        track slot) of the reserved track depth strictly inside it, which the forward writes
        (Batch.tracks), or None."""
        start = req.device_len
        for depth, slot in self.tracks.get(req.rid, {}).items():
            if start < depth < start + n:
                return depth - start, slot
        return None

    def plan_fork(self, req: Req, path_len: int) -> None:
        """At admission, after `reserve` and `req.admit`: plan `req`'s fork snapshot at the
        deepest grid boundary <= `path_len` (PrefixMatch.path_len) when it lies past
        req.cached_len, is no track depth and no running request has claimed it."""
        depth = path_len // self.grid * self.grid
        if (not self.forks_on or depth <= req.cached_len or depth >= req.prompt_len
                or depth in self.tracks.get(req.rid, {})):
            return
        key = tuple(req.prompt_ids[:depth + 1])  # +1: lookahead keys pair t_depth in
        if key in self.claims:
            return
        self.claims[key] = req.rid
        self.forks[req.rid] = (depth, key)

    # ---- slots --------------------------------------------------------------------------
    def reclaimable(self) -> int:
        """Chunk-snapshot slots `reclaim` could give back now."""
        return sum(len(depths) for _, depths in self.chunk.values())

    def available_slots(self) -> int:
        """Slots `take_slot` can hand out now: free, evictable from the cache, reclaimable."""
        return self.state_pool.num_free + self.cache.evictable_slots() + self.reclaimable()

    def reclaim(self, n: int) -> int:
        """Free up to `n` chunk-snapshot slots of running requests (the request holding most
        first, its deepest snapshot first); returns how many were freed. The requests keep
        running; they simply will not leave those snapshots in the cache."""
        freed = 0
        while freed < n and self.chunk:
            rid = max(self.chunk, key=lambda r: len(self.chunk[r][1]))
            req, depths = self.chunk[rid]
            self.state_pool.free(req.snapshots.pop(depths.pop()))
            if not depths:
                del self.chunk[rid]
            freed += 1
        return freed

    def take_slot(self) -> int:
        """A slot for a live state or a track snapshot: free, else evicted from the cache,
        else reclaimed from a running request. Asserts `available_slots() >= 1` held."""
        if not self.state_pool.can_allocate(1):
            self.cache.evict(n_slots=1)
        if not self.state_pool.can_allocate(1):
            self.reclaim(1)
        return self.state_pool.allocate()

    def _try_take_slot(self) -> int | None:
        if not self.state_pool.can_allocate(1) and self.cache.evictable_slots() > 0:
            self.cache.evict(n_slots=1)
        return self.state_pool.allocate() if self.state_pool.can_allocate(1) else None

    def _copy_out(self, req: Req) -> tuple[int, bool] | None:
        """The live state of `req` copied to a device slot, else stored into a free bank slot:
        (slot, on the host), or None when neither tier has one."""
        slot = self._try_take_slot()
        if slot is not None:
            self.state_pool.copy(req.slot, slot)
            return slot, False
        bank = self.cache.host_bank
        if bank is None or not bank.can_allocate(1):
            return None
        host = bank.allocate()
        bank.store(self.state_pool, req.slot, host)  # ordered before the next chunk
        return host, True

    def _keep(self, req: Req, d: int, slot: int, host: bool) -> None:
        """Record a snapshot at depth d that enters the tree with `req`'s release."""
        if host:
            req.host_snapshots[d] = slot
            self.n_to_host += 1
        else:
            req.snapshots[d] = slot
            self.chunk.setdefault(req.rid, (req, []))[1].append(d)

    # ---- request life -------------------------------------------------------------------
    def reserve(self, req: Req, depths: list[int]) -> None:
        """At admission: take one track slot per depth (their contents are written when the
        prefill reaches the depth). The caller checked `available_slots()`."""
        self.tracks[req.rid] = {d: self.take_slot() for d in depths}

    def after_chunk(self, req: Req) -> None:
        """After a prefill chunk of `req` ran (req.device_len is its end): copy the live state
        into the track slot reserved at that depth, or take a chunk snapshot when the end is
        an intermediate grid depth far enough past the previous snapshot; a track depth the
        chunk ran past was written by the forward and is recorded. Mutates req.snapshots and
        the state pool; the live slot is unchanged."""
        d = req.device_len
        tracks = self.tracks.get(req.rid, {})
        for depth, slot in tracks.items():
            if depth < d and depth not in req.snapshots:  # inside the chunk (Batch.tracks)
                req.snapshots[depth] = slot
        if d in tracks:
            self.state_pool.copy(req.slot, tracks[d])
            req.snapshots[d] = tracks[d]
            return
        fork = self.forks.get(req.rid)
        if fork is not None and fork[0] == d:
            self._take_fork(req, fork[1])
            return
        if not self.chunk_snapshots_on or d >= req.prompt_len or d % self.grid:
            return
        # the fork counts against the cap from admission on, and spaces what follows it
        taken = {x for x in (*req.snapshots, *req.host_snapshots) if x not in tracks}
        if fork is not None:
            taken.add(fork[0])
        if len(taken) >= self.max_per_prompt:
            return
        previous = max((x for x in taken if x < d), default=req.cached_len)
        if d - previous < self.interval(req.prompt_len):
            return
        got = self._copy_out(req)
        if got is None:
            self.n_skipped += 1
            return
        self._keep(req, d, *got)
        self.n_taken += 1

    def _take_fork(self, req: Req, key: tuple[int, ...]) -> None:
        """The fork depth is reached: copy the live state out and give it to the tree at
        once, else keep it as a chunk snapshot; the claim ends either way."""
        del self.claims[key]
        got = self._copy_out(req)
        if got is None:
            self.n_forks_skipped += 1
            return
        self.n_forks += 1
        slot, host = got
        if not self.cache.attach(key, req.device_len, slot, host=host):
            self._keep(req, req.device_len, slot, host)

    def release(self, req: Req) -> set[int]:
        """Forget `req` (its fork plan and claim too): returns every device slot it holds
        besides its live slot (track slots, taken or not, and chunk snapshots).
        `req.snapshots` still names the taken ones and `req.host_snapshots` the bank's; the
        caller gives them to the cache or frees them."""
        held = set(self.tracks.pop(req.rid, {}).values())
        self.chunk.pop(req.rid, None)
        fork = self.forks.pop(req.rid, None)
        if fork is not None and self.claims.get(fork[1]) == req.rid:  # released before it
            del self.claims[fork[1]]
        return held | set(req.snapshots.values())
