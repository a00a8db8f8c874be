"""MTP proposer: the checkpoint's multi-token-prediction head drafts k tokens per request.

The head at position j reads (t_{j+1}, h_j), h_j the target's final hidden state at j, and
predicts t_{j+2} (DESIGN.md, "Models"). Its attention layer keeps KV in a draft pool indexed by
the target's page indices, so the prefix cache (with lookahead keys: the draft KV at j depends
on t_{j+1}) serves both.

Per request the proposer keeps `mtp_len`, the positions whose draft KV is exact, and the target
hidden states of the positions after it. `_catch_up` runs the head over every position whose
next token is known (after a prefill chunk, after a verify commits, before a finished request's
pages go to the cache); its last row at position device_len - 1 yields the first draft. Drafts
2..k chain the head's own output hidden state one position further each step (their KV is
speculative and is rewritten by the next catch-up).

With `use_graphs` (the engine's CUDA graphs on) a verify's committed rows are not caught up at
once: the next verify step's `propose` runs their catch-up and the k drafts as one graph replay
(spec/mtp/graph.py) and returns the drafts as a device tensor; a plain decode step's row
waits for it too, and so does every row of a decode step launched ahead of the host (overlap
scheduling); rows past the last k+1 are caught up eagerly, without a host sync, right before
the replay. A decode step launched ahead costs the host one list append here (`_ahead`): its
rows are filed per request only when something reads the states (`states` does it), a run of
such steps with the same requests as one stacked tensor, and a run of `AHEAD_CAP` steps is
caught up eagerly then (the adaptive policy's long runs of plain steps would otherwise hold
every step's hidden states). Whatever that graph does not cover (a prefill chunk's rows, more
than k+1 rows left by decode steps, a finished request's last rows when the prefix cache keeps
them, a batch past the graphs' buckets) runs the eager path here, which gives the same drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.core import FinishReason, ForwardContext, Phase
from deltaserve.engine.attention import AttentionMetadata, PagedAttentionBackend
from deltaserve.engine.cuda_graph import VerifyChain, ring_held_fit
from deltaserve.engine.staging import row_positions, to_device
from deltaserve.ops._ext import count_from_env
from deltaserve.spec.mtp.graph import MTPGraphs
from deltaserve.spec.proposer import Proposer

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req


# Decode steps launched ahead that may wait for a catch-up (module doc), at most: each eager
# catch-up costs the host its launches whatever its rows, so rarer is cheaper. On an H100
# (session 46, held-out prompts, 512 tokens, one call) speculation on with every step plain
# ran 0.95x / 0.96x of speculation off at batch 1 / 8 with 128, 0.98x / 0.99x with 1024.
# `use_graphs` lowers it to what fits the plain decode graphs' hidden-state ring
# (engine/cuda_graph.py RING_BYTES), not below MIN_AHEAD_CAP. DS_MTP_AHEAD_CAP (1..4096, read
# at import) moves it for A/B runs.
AHEAD_CAP = max(1, count_from_env("DS_MTP_AHEAD_CAP", 1024, 4096))
MIN_AHEAD_CAP = 128


def ahead_cap(step_bytes: int, k: int) -> int:
    """AHEAD_CAP, lowered to what keeps the plain decode graphs' hidden-state ring (for the
    cap + 2 (k + 1) steps held of `step_bytes`: engine/cuda_graph.py ring_held_fit) within
    RING_BYTES, not below min(AHEAD_CAP, MIN_AHEAD_CAP) (past that the ring is off and the
    host clones each step's rows, as before the cap grew)."""
    fit = ring_held_fit(step_bytes) - 2 * (k + 1)
    return max(min(AHEAD_CAP, fit), min(AHEAD_CAP, MIN_AHEAD_CAP))


@dataclass(slots=True)
class _Rows:
    """Rows [start, start + n) of `src` [T, H]: target hidden states of consecutive positions."""

    src: torch.Tensor
    start: int
    n: int


@dataclass
class _ReqState:
    mtp_len: int  # draft KV is exact for positions < mtp_len
    pending: list[_Rows] = field(default_factory=list)  # h_j for j = mtp_len, mtp_len + 1, ..
    first: tuple[torch.Tensor, int] | None = None  # (head output at device_len-1, its draft)
    first_at: int = -1  # the device_len `first` was computed for


class MTPProposer(Proposer):
    """k autoregressive argmax drafts from `model.mtp` (see module doc)."""

    wants_hidden = True

    def __init__(self, model, runner, num_steps: int, cfg) -> None:
        self.model, self.head = model, model.mtp
        self.kv = runner.draft_kv
        self.device = runner.device
        self.num_steps = num_steps
        self._states: dict[int, _ReqState] = {}
        # decode steps launched ahead, not yet filed per request: (hidden [B, H], requests)
        self._ahead: list[tuple[torch.Tensor, list[Req]]] = []
        self.ahead_cap = AHEAD_CAP  # `use_graphs` fits it to the hidden-state ring
        self._verify_hidden: torch.Tensor | None = None
        self.graphs: MTPGraphs | None = None  # set by use_graphs
        # a finished request's draft KV matters only to the prefix cache
        self.cache_draft_kv = cfg.enable_prefix_cache

    @property
    def states(self) -> dict[int, _ReqState]:
        """Per request: the head's position and the rows it has yet to catch up (with every
        decode step launched ahead filed)."""
        if self._ahead:
            self._file_ahead()
        return self._states

    def _file_ahead(self) -> None:
        """File the logged decode steps' rows per request: a run of steps of the same
        requests (the usual case) as one stacked [steps, B, H] tensor, one _Rows each."""
        log, self._ahead = self._ahead, []
        i = 0
        while i < len(log):
            reqs = log[i][1]
            j = i + 1
            while j < len(log) and len(log[j][1]) == len(reqs) \
                    and all(a is b for a, b in zip(log[j][1], reqs)):
                j += 1
            run = torch.stack([h for h, _ in log[i:j]]) if j - i > 1 else log[i][0][None]
            for row, req in enumerate(reqs):
                st = self._states.get(req.rid)
                if st is not None:  # else released meanwhile
                    st.pending.append(_Rows(run[:, row], 0, j - i))
            i = j

    @property
    def hidden_steps_held(self) -> int:
        """With graphs, a decode step's hidden rows are copied (stacked, concatenated or
        caught up) by the time `ahead_cap` more steps launched ahead, or k + 1 more steps of its
        request, ran. The eager proposer holds rows launched ahead until the next verify,
        however far (0: no bound)."""
        return self.ahead_cap + 2 * (self.num_steps + 1) if self.graphs is not None else 0

    @property
    def chains_verify(self) -> bool:
        return self.graphs is not None

    def use_graphs(self, max_reqs: int, max_kv_len: int, capture: bool = True) -> None:
        """Run verify steps' catch-up and drafts as graphs of up to max_reqs requests and
        max_kv_len positions (capture=False: the same fixed-shape step, eagerly)."""
        c = self.model.config
        self.graphs = MTPGraphs(self.head, self.model.compute_logits, self.kv, c.hidden_size,
                                self.model.dtype, self.device,
                                self.num_steps, max_reqs, max_kv_len, capture)
        self.ahead_cap = ahead_cap(max_reqs * c.hidden_size * self.model.dtype.itemsize,
                                   self.num_steps)

    # ---- hooks --------------------------------------------------------------------------
    def on_forward(self, batch: Batch, hidden: torch.Tensor | None) -> None:
        if batch.phase is Phase.VERIFY:
            self._verify_hidden = hidden
            return
        states = self._states
        if self.graphs is not None and batch.phase is Phase.DECODE \
                and all(r.ahead and r.rid in states for r in batch.reqs):
            self._ahead.append((hidden, batch.reqs))  # filed when read (`states`)
            if len(self._ahead) >= self.ahead_cap:  # landed rows through the head, no sync
                self._catch_up(batch.reqs, keep=self.num_steps + 1)
            return
        states = self.states
        off = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            st = states.get(req.rid)
            if st is None:
                st = states[req.rid] = _ReqState(mtp_len=req.device_len)
            st.pending.append(_Rows(hidden, off, n))
            off += n
        # a row launched ahead of the host (overlap scheduling: Req.ahead) waits for the next
        # verify's proposer, which catches it up: catching up here would wait for the GPU
        reqs = [r for r in batch.reqs if not r.ahead]
        if self.graphs is not None and batch.phase is Phase.DECODE:
            # a plain decode step runs no proposer: its rows wait for the next verify's graph,
            # unless that would leave more than k+1 rows to catch up (then all known rows now)
            reqs = [r for r in reqs if r.device_len - self.states[r.rid].mtp_len
                    >= self.num_steps + 1]
        if reqs:
            self._catch_up(reqs)

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        rows = batch.rows_per_req
        for i, (req, c) in enumerate(zip(batch.reqs, committed)):
            if c and req.rid in self.states:
                self.states[req.rid].pending.append(_Rows(self._verify_hidden, i * rows, c))
        self._verify_hidden = None
        # with graphs the next verify's replay catches these rows up; a request that finished
        # in this step catches up here, with the others, when the prefix cache keeps its KV
        todo = [r for r, c in zip(batch.reqs, committed)
                if c and (self.graphs is None or (r.finished and self.cache_draft_kv))]
        if todo:
            self._catch_up(todo)

    def on_chained_commit(self, batch: Batch, committed: list[int]) -> None:
        """After a verify step whose committed rows the next step's `propose_chained` already
        caught up on the device: request i's draft KV is exact through device_len +
        committed[i] (its state is that of a finished catch-up, nothing pending)."""
        for req, c in zip(batch.reqs, committed):
            st = self.states.get(req.rid)
            if c and st is not None:
                st.mtp_len, st.pending, st.first, st.first_at = req.device_len + c, [], None, -1

    def release(self, req: Req) -> None:
        if req.finish_reason is not FinishReason.ABORT and req.rid in self.states \
                and self.cache_draft_kv:
            self._catch_up([req])  # the cache keeps this request's draft KV: make it exact
        self.states.pop(req.rid, None)

    # ---- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req]) -> list[list[int]] | torch.Tensor:
        """k drafts per request: a device tensor [N, k] from one graph replay when the batch
        fits the graphs, else lists from the eager path (empty for a request the head has no
        state for)."""
        if self.graphs is not None:
            drafts = self._propose_graph(reqs)
            if drafts is not None:
                return drafts
        self._catch_up(reqs)
        drafts, hidden, tokens, live = [], [], [], []
        for i, req in enumerate(reqs):
            st = self.states.get(req.rid)
            if st is None or st.first is None or st.first_at != req.device_len:
                drafts.append([])
                continue
            h, tok = st.first
            drafts.append([tok])
            hidden.append(h)
            tokens.append(tok)
            live.append(i)
        if not live or self.num_steps == 1:
            return drafts
        # Drafts 2..k stay on the device between steps (one host sync for all of them, so
        # the launches of step i+1 are enqueued while step i runs).
        sub = [reqs[i] for i in live]
        h = torch.stack(hidden)
        tok = torch.tensor(tokens, dtype=torch.long, device=h.device)
        steps = []
        for step in range(1, self.num_steps):
            starts = [r.device_len + step - 1 for r in sub]
            h = self._run(sub, starts, [1] * len(sub), tok, h)
            tok = torch.argmax(self.model.compute_logits(h), dim=-1)
            steps.append(tok)
        for j, row in enumerate(torch.stack(steps, dim=1).tolist()):
            drafts[live[j]].extend(row)
        return drafts

    @torch.inference_mode()
    def propose_chained(self, reqs: list[Req], chain: VerifyChain,
                        hidden: torch.Tensor) -> torch.Tensor | None:
        """Drafts [N, k] for a verify step launched before the previous verify step of `reqs`
        (same order) landed: one graph replay whose catch-up rows are that step's committed
        rows, read on the device (`chain`; `hidden` [N*(k+1), H] its target hidden states).
        None when the batch does not fit the graphs or a request has rows to catch up from
        before that step (the caller lands it first)."""
        if self.graphs is None:
            return None
        rows = self.num_steps + 1
        b = self.graphs.bucket(len(reqs), max(chain.starts) + rows)
        if b is None:
            return None
        for req, start in zip(reqs, chain.starts):
            st = self.states.get(req.rid)
            if st is None or st.mtp_len != start or st.pending:
                return None
        return self.graphs.run_chained(b, chain.starts, chain.counts, chain.greedy,
                                       [r.page_table for r in reqs], hidden)

    def _catch_up(self, reqs: list[Req], keep: int = 0) -> None:
        """Run the head over each request's positions [mtp_len, len(all_ids) - 1 - keep).
        keep > 0 leaves the last `keep` known rows pending for the graph step and computes no
        first draft (no host synchronisation)."""
        todo, starts, lens, ids, hid = [], [], [], [], []
        for req in reqs:
            st = self.states.get(req.rid)
            if st is None or not st.pending:
                continue
            n = min(sum(p.n for p in st.pending), req.num_tokens - 1 - st.mtp_len) - keep
            if n <= 0:
                continue
            have = torch.cat([p.src[p.start:p.start + p.n] for p in st.pending])
            todo.append(req)
            starts.append(st.mtp_len)
            lens.append(n)
            ids.extend(req.tokens(st.mtp_len + 1, st.mtp_len + 1 + n))
            hid.append(have[:n])
            rest = have.shape[0] - n
            st.pending = [_Rows(have, n, rest)] if rest else []
        if not todo:
            return
        with torch.inference_mode():
            out = self._run(todo, starts, lens, ids, torch.cat(hid))
            if not keep:
                ends = torch.tensor(lens, device=out.device).cumsum(0) - 1
                last = out[ends]
                first = torch.argmax(self.model.compute_logits(last), dim=-1).tolist()
        for j, (req, start, n) in enumerate(zip(todo, starts, lens)):
            st = self.states[req.rid]
            st.mtp_len = start + n
            st.first, st.first_at = ((None, -1) if keep
                                     else ((last[j], first[j]), st.mtp_len))

    def _propose_graph(self, reqs: list[Req]) -> torch.Tensor | None:
        """Drafts [N, k] from one replay of the MTP graph, or None when a request does not fit
        it (no state, rows to catch up outside 1..k+1, too long, too many requests)."""
        k, rows = self.num_steps, self.num_steps + 1
        b = self.graphs.bucket(len(reqs), max(r.device_len for r in reqs))
        if b is None:
            return None
        # rows left by overlapped decode steps (their catch-up was deferred): all but the last
        # k+1 through the eager head first, without a host sync
        excess = [r for r in reqs if r.rid in self.states
                  and r.device_len - self.states[r.rid].mtp_len > rows]
        if excess:
            self._catch_up(excess, keep=rows)
        states = []
        for req in reqs:
            st = self.states.get(req.rid)
            if st is None:
                return None
            n = req.device_len - st.mtp_len
            if not 1 <= n <= rows or sum(p.n for p in st.pending) != n:
                return None
            states.append(st)
        # steady state: every row comes from the previous verify's hidden states (one source,
        # gathered in place); otherwise only the pending rows are concatenated (a prefill
        # chunk's hidden states can be thousands of rows)
        single = len({id(p.src) for st in states for p in st.pending}) == 1
        pieces: list[torch.Tensor] = []
        total = 0  # rows in pieces
        # flat lists, then one numpy write each (a slice write per request was ~3 µs of host
        # time a request at batch 32)
        at: list[int] = []  # rows of ids / gather that real rows fill
        tok: list[int] = []
        src_rows: list[int] = []
        for i, (req, st) in enumerate(zip(reqs, states)):
            at.extend(range(i * rows, i * rows + req.device_len - st.mtp_len))
            tok += req.tokens(st.mtp_len + 1, req.device_len + 1)
            for p in st.pending:
                base = p.start if single else total
                if not single:
                    pieces.append(p.src[p.start:p.start + p.n])
                    total += p.n
                src_rows.extend(range(base, base + p.n))
        ids = np.zeros(b * rows, dtype=np.int64)
        gather = np.zeros(b * rows, dtype=np.int64)
        ids[at] = tok
        gather[at] = src_rows  # request i's pending rows cover exactly its catch-up rows
        src = states[0].pending[0].src if single else torch.cat(pieces)
        starts = [st.mtp_len for st in states]
        counts = [r.device_len - st.mtp_len for r, st in zip(reqs, states)]
        drafts = self.graphs.run(b, ids, gather, starts, counts, [r.page_table for r in reqs],
                                 src)
        for req, st in zip(reqs, states):
            st.mtp_len, st.pending, st.first, st.first_at = req.device_len, [], None, -1
        assert drafts.shape == (len(reqs), k)
        return drafts

    def _run(self, reqs: list[Req], starts: list[int], lens: list[int],
             ids: list[int] | torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward: rows of request i at positions starts[i] .. starts[i]+lens[i]-1;
        ids: the token after each row (a list, or a long tensor already on the device)."""
        dev = self.device
        # every upload through pinned staging: a copy from pageable memory waits for the
        # stream, which would drain the overlap pipeline at each deferred catch-up
        meta = AttentionMetadata.build([r.page_table for r in reqs], starts, lens,
                                       self.kv.page_size, dev,
                                       lambda a: to_device(a, torch.int64, dev),
                                       dtype=self.kv.k.dtype)
        ctx = ForwardContext(positions=to_device(row_positions(starts, lens), torch.int64, dev),
                             attn=PagedAttentionBackend(self.kv, meta), gdn=None)
        if not isinstance(ids, torch.Tensor):
            ids = to_device(ids, torch.int64, dev)
        return self.head(ids, hidden, ctx)
