"""Overlapped verify steps: verify step n+1 is launched before step n's tokens reach the host.

(SGLang's overlapped speculative decoding, vLLM's async scheduling with speculation.) A
synchronous verify step waits for its accepted tokens on the host before the next step can
be built: the next drafts continue the tokens it commits, and the next rows start where it
stopped. With MTP drafts and greedy acceptance, all of that is on the device already:
- the verify graph computes the acceptance (`ForwardOutput.accepted`: per request the number
  of accepted drafts a and the target's token after each row, spec/accept.py);
- committing its rows (conv windows written, GDN rows left pending for the next verify's own
  launch, `PoolGDNBackend.commit`) takes device counts;
- the MTP graph's catch-up rows are exactly the rows it commits: their next tokens are the
  target's argmax rows and their hidden states its hidden rows, and the graph computes its
  lengths and positions itself (`MTPGraphs.run_chained`);
- the next verify's pending token is the target's token at row a, and its rows start a + 1
  positions on (`GraphRunner.forward(chain=...)`, `VerifyChain`).
So launching step n+1 commits step n's rows on the device (untruncated: the host has not seen
a stop yet), replays the MTP graph and the verify graph and starts the copy of step n+1's
acceptance to pinned memory; then step n lands: the host waits for its copy and commits its
tokens (stop checks, detokenizing, outputs) while the GPU runs step n+1.

When: `--overlap-verify`, the MTP proposer with graphs, the verify batch in a graph bucket,
every request plain greedy and overlappable (engine/overlap.py) and at least 2(k+1) positions
short of its max_len (the next rows must fit whatever step n accepts). A step is chained
behind the one in flight for that one's requests still running (a request that finished
when an earlier step landed is left out), in the same order, if nothing else runs or was
admitted and the policy wants k drafts. Otherwise the step in flight lands first and the
next call schedules as usual.

Hazards, and why they are harmless:
- A request that finishes at step n (a stop among its accepted tokens, max_tokens) is already
  in step n+1, whose launch committed step n's rows past the stop on the device: its live GDN
  state is past device_len, so release caches no snapshot of it (`Req.ahead` > 0 while a
  chained step of it is in flight, as for overlapped decode steps); its KV and draft KV below
  device_len are exact. Its row of step n+1 is discarded when that step lands.
- Pages: step n+1 writes KV up to 2(k+1) positions past step n's start; they are taken at its
  launch (within what admission reserved) and `rollback_tail` keeps them while `ahead` > 0.
- Graph outputs (the acceptance, the argmax rows) are overwritten by the next verify replay:
  whatever reads step n's (the copy to the host, the commit, the MTP replay, the pending
  token's gather) is enqueued before step n+1's replay. Hidden states are copies.
- An abort while a step runs: as for overlapped decode steps (engine/overlap.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltaserve.core import Batch, Phase, Req
from deltaserve.engine.cuda_graph import VerifyChain
from deltaserve.engine.gdn_backend import PoolGDNBackend
from deltaserve.engine.model_runner import ForwardOutput
from deltaserve.engine.requests import overlappable
from deltaserve.engine.staging import CopyBack, to_device

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import LLMEngine, RequestOutput


@dataclass
class VerifyInFlight:
    """A launched verify step whose acceptance the host has not read: `out` its outputs
    (greedy [N*(k+1)], accepted [N, k+2] on the device, valid until the next verify replay;
    hidden a copy), `host` int64 [N, k+2] (pinned on CUDA) receiving `out.accepted` before
    `event` (None on a CPU); `gdn` and `slot_ids` what its commit needs; `chained`: launched
    behind the step before it; `committed_on_device`: the next step's launch committed its
    rows (with the counts the device saw)."""

    batch: Batch
    out: ForwardOutput
    host: torch.Tensor
    event: torch.cuda.Event | None
    gdn: PoolGDNBackend
    slot_ids: list[int]
    launched_at: float
    chained: bool
    committed_on_device: bool = False


def chainable(req: Req, rows: int) -> bool:
    """Whether `req` may run in a verify step launched ahead of the host: plain greedy (the
    graph's acceptance is its tokens), nothing on the host derived from its last token, past
    its prompt, and room for the next step's rows whatever this one accepts."""
    p = req.params
    return (not req.finished and not req.in_prefill and p.greedy and overlappable(req)
            and req.device_len + 2 * rows <= req.max_len)


class VerifyOverlap:
    """Launches and lands verify steps for the OverlapScheduler (see the module doc).

    Counters, for tests and benchmarks: `launched_steps` (verify steps launched here) and
    `chained_steps` (of those, launched before the previous one landed).
    """

    def __init__(self, engine: LLMEngine, commit_landed: Callable[..., list[RequestOutput]]
                 ) -> None:
        self.engine = engine
        self.commit_landed = commit_landed  # OverlapScheduler's: commit, count, log, outputs
        cfg = engine.cfg
        self._copies = CopyBack((cfg.max_running_reqs, cfg.decode_rows_per_req + 1),
                                engine.device)  # the acceptance
        self.launched_steps = 0
        self.chained_steps = 0

    @property
    def on(self) -> bool:
        eng = self.engine
        return (eng.cfg.overlap_verify and eng.graphs is not None and eng.spec is not None
                and eng.graphs.phase is Phase.VERIFY and eng.spec.chains_verify)

    def can_launch(self, batch: Batch) -> bool:
        """A scheduled verify batch that may run without waiting for its acceptance."""
        rows = batch.rows_per_req
        return (self.on and batch.phase is Phase.VERIFY
                and all(chainable(r, rows) for r in batch.reqs)
                and self.engine.graphs.bucket(batch) is not None)

    # ---- launch -------------------------------------------------------------------------
    def launch(self, batch: Batch) -> VerifyInFlight:
        """Propose and replay a scheduled verify batch (`can_launch`), start the copy back."""
        eng = self.engine
        launched_at = time.perf_counter()
        eng.spec.propose(batch)
        out = eng.graphs.forward(batch, keep_hidden=True)
        assert out is not None, "can_launch checked the bucket"
        return self._started(batch, out, launched_at, chained=False)

    def launch_chained(self, prev: VerifyInFlight) -> VerifyInFlight | None:
        """The next verify step of `prev`'s requests that are still running (same order),
        launched before `prev` lands; None when it may not be (see the module doc), with
        nothing changed but admissions."""
        eng, sched = self.engine, self.engine.scheduler
        k = eng.spec.num_steps
        rows = k + 1
        live = [i for i, r in enumerate(prev.batch.reqs) if not r.finished]
        reqs = [prev.batch.reqs[i] for i in live]
        if not reqs or not all(chainable(r, rows) for r in reqs):
            return None
        sched.admit()
        if [r.rid for r in sched.running] != [r.rid for r in reqs]:
            return None
        if sched.choose_drafts is not None and sched.choose_drafts(reqs) != k:
            return None
        starts = [r.device_len for r in reqs]
        batch = Batch(Phase.VERIFY, reqs, [rows] * len(reqs), rows_per_req=rows)
        if eng.graphs.bucket(batch, [s + rows for s in starts]) is None:
            return None
        launched_at = time.perf_counter()
        for req, start in zip(reqs, starts):  # within what admission reserved
            sched.ensure_pages(req, start + 2 * rows)
        counts = prev.out.accepted[:, 0] + 1  # every row of prev
        greedy, hidden = prev.out.greedy.view(-1, rows), prev.out.hidden
        gone = len(prev.batch.reqs) - len(live)  # finished when an earlier step landed
        if gone:
            index = to_device(live, torch.long, counts.device)
            greedy = greedy.index_select(0, index)
            hidden = hidden.view(len(prev.batch.reqs), rows, -1).index_select(0, index)
            hidden = hidden.view(len(live) * rows, -1)
        chain = VerifyChain(starts, counts if not gone else counts.index_select(0, index),
                            greedy)
        if not eng.spec.propose_chained(batch, chain, hidden):
            return None
        # prev's rows committed with the counts its graph computed (0 for requests already
        # finished: their slots may have a new owner)
        padded = torch.zeros(prev.gdn.meta.slots.shape[0], dtype=torch.int32,
                             device=counts.device)
        padded[:len(prev.batch.reqs)] = counts
        if gone:
            dead = [i for i, r in enumerate(prev.batch.reqs) if r.finished]
            padded.index_fill_(0, to_device(dead, torch.long, counts.device), 0)
        prev.gdn.commit(padded, prev.slot_ids)
        prev.committed_on_device = True
        for req in reqs:
            req.launch_ahead()
        out = eng.graphs.forward(batch, keep_hidden=True, chain=chain)
        assert out is not None, "the bucket was checked"
        self.chained_steps += 1
        return self._started(batch, out, launched_at, chained=True)

    def _started(self, batch: Batch, out: ForwardOutput, launched_at: float,
                 chained: bool) -> VerifyInFlight:
        eng = self.engine
        eng.spec.on_forward(batch, out.hidden)
        host, event = self._copies.start(out.accepted)
        self.launched_steps += 1
        return VerifyInFlight(batch, out, host, event, eng.runner.last_gdn,
                              list(eng.runner.last_slot_ids), launched_at, chained)

    # ---- land ---------------------------------------------------------------------------
    def land(self, prev: VerifyInFlight) -> list[RequestOutput]:
        """Wait for `prev`'s acceptance, commit its tokens and return its outputs (requests
        that finished before it landed are skipped)."""
        if prev.event is not None:
            prev.event.synchronize()
        rows = prev.host.tolist()
        eng, batch = self.engine, prev.batch
        early = eng.flush_outputs()
        if prev.chained:
            for req in batch.reqs:
                req.land_ahead()
        tokens = [row[1:row[0] + 2] for row in rows]  # accepted drafts + 1, then the tokens
        return early + self.commit_landed(batch, tokens, prev.launched_at,
                                          lambda counts: self._commit_rows(prev, counts))

    def _commit_rows(self, prev: VerifyInFlight, counts: list[int]) -> None:
        eng = self.engine
        if prev.committed_on_device:
            eng.spec.on_chained_commit(prev.batch, counts)
        else:
            pad = prev.gdn.meta.slots.shape[0] - len(counts)
            prev.gdn.commit(to_device(counts + [0] * pad, torch.int32, eng.device),
                            prev.slot_ids)
            eng.spec.on_commit(prev.batch, counts)
        eng.count_verify(prev.batch, counts)
