"""Overlap scheduling: the host builds and launches decode step n+1 while the GPU runs step n.

(SGLang's overlap scheduler, vLLM's async scheduling.) A synchronous decode step builds its
inputs, replays the graph, copies the tokens back (the host waits for the GPU) and commits them
(stop checks, detokenizing), so every microsecond of host work adds to the step. Here each
`step()` call first launches step n+1, then processes step n while step n+1 runs:

- launch(n+1): its positions, slots and pages are known on the host before step n's tokens
  are (a decode request advances exactly one token per step: it feeds position device_len +
  ahead, `Req.ahead`; its pages up to max_len were reserved at admission, `ensure_pages` only
  takes them). Its input tokens are step n's sampled tokens, gathered on the device through a
  staged row index (`DeviceTokens`; none when the rows keep their order, the usual case);
  sampling runs on the device (`sample`), and the step's tokens go to pinned memory in one
  non-blocking copy followed by an event.
- land(n): wait for step n's event (step n+1 is queued behind it, so the GPU stays busy), then
  commit, stop checks, detokenize and build the outputs, as the synchronous step does.

A call's outputs are therefore those of the step launched by the previous call; the first
decode step of a run returns none.

Hazards, and why they are harmless:
- A request that finishes at step n on a token it sampled (EOS, a stop token or string) is
  already in step n+1: that row is discarded when it lands (the scheduler skips finished
  requests; nothing is emitted or committed). Its live GDN state then holds one token past
  device_len, so release caches no snapshot of it (`Req.ahead`, scheduler.release); its KV
  row lies past the pages the prefix cache keeps. A finish by length is known one step early
  on the host: such a request is left out of step n+1, so its end snapshot stays exact.
- An abort while a step runs frees the request's pages and slots at once. Whatever writes them
  for a new owner (admission's restore or zeroing, prefill, later steps, host-bank copies that
  wait on the compute stream) is enqueued on the device after the in-flight step, so that
  step's writes land first and are overwritten. The host never reads the device memory of a
  freed slot or page.
- Graph outputs are overwritten by the next replay (of any bucket: they share a memory pool):
  the gather of step n's tokens into step n+1's inputs and their copy to the host are both
  enqueued before step n+1's replay.
- Seeded sampling: a row of step n+1 samples output position len(output_ids) + ahead, the
  position the synchronous path samples one step later, so the tokens are the same.

With speculation and the adaptive policy (spec/policy.py), the plain decode steps the policy
picks overlap the same way through the engine's decode graphs. A verify step overlaps only
with `--overlap-verify` (engine/overlap_verify.py: the next verify's positions and drafts come
from the device); otherwise it runs synchronously. Before launching step n+1 the
policy is asked (`choose` is pure): when it wants a verify, step n lands and the next call runs
the verify synchronously. Every decode or verify step's cost for the policy is its period from
the previous one's landing to its own (spec/policy.py StepClock), so the policy weighs verify
steps against decode steps as they really run, switches included. The proposer sees each
overlapped step's hidden states at launch (`on_forward`, rows whose requests have `ahead` > 0:
the MTP proposer defers their catch-up to the next verify instead of waiting for the GPU).

Synchronous fallback (the in-flight step lands first; the next call runs today's step):
prefill batches and admissions, verify steps, rows that need host data derived from the
previous token (penalties, grammar, token healing, logprobs), a batch no graph bucket holds,
and no decode graphs at all (a CPU device, --disable-cuda-graphs, tensor parallel, the fixed
speculation policy). `EngineConfig.overlap_schedule` (--disable-overlap-schedule) turns it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltaserve.core import Batch, Phase, Req
from deltaserve.engine.cuda_graph import DeviceTokens
from deltaserve.engine.overlap_verify import VerifyInFlight, VerifyOverlap
from deltaserve.engine.requests import overlappable
from deltaserve.engine.sampling import SamplingRow, SamplingTensors, sample
from deltaserve.engine.staging import CopyBack, to_device

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import LLMEngine, RequestOutput


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not processed: row i of `batch` sampled
    tokens[i] (int64 [N] on the device), copied to `host` (int64 [N], pinned on CUDA) before
    `event` (None on a CPU device, where the copy is done at once)."""

    batch: Batch
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None
    launched_at: float  # time.perf_counter() at launch


def finishes_by_length(req: Req) -> bool:
    """Whether the tokens launched for `req` (`req.ahead` of them) make it reach max_tokens or
    its max_len when they land, whatever they are: it must not get another row."""
    n = req.ahead
    return len(req.output_ids) + n >= req.output_budget() or req.num_tokens + n >= req.max_len


class OverlapScheduler:
    """Drives `engine`'s steps with overlap (see the module doc). `enabled` may be switched
    between steps (benchmarks compare both); a step still in flight then lands first.

    Counters, for tests and benchmarks: `launched_steps` and `launched_rows` (decode steps
    and their request rows launched here), `overlapped_steps` (of those, launched before the
    previous step landed), `discarded_rows` (rows that landed for a request already finished:
    stopped one step earlier, or aborted).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.enabled = True
        self.inflight: InFlight | VerifyInFlight | None = None
        self._copies = CopyBack((engine.cfg.max_running_reqs,), engine.device)  # the tokens
        self.launched_steps = 0
        self.launched_rows = 0
        self.overlapped_steps = 0
        self.discarded_rows = 0
        # verify steps launched ahead (overlap_verify.py)
        self.verify = VerifyOverlap(engine, self.commit_landed)

    @property
    def graphs(self):
        """The decode GraphRunner: the engine's graphs, or with speculation its decode_graphs
        (None under the fixed policy, which never runs a plain decode step)."""
        eng = self.engine
        return eng.graphs if eng.spec is None else eng.decode_graphs

    @property
    def active(self) -> bool:
        """New decode steps may be overlapped: enabled, and decode graphs exist."""
        graphs = self.graphs
        return self.enabled and graphs is not None and graphs.phase is Phase.DECODE

    def step(self) -> list[RequestOutput]:
        """One engine step: launch the next decode step when it can run ahead, then land the
        one in flight; without one in flight, schedule normally and run the batch (a decode
        batch that can overlap is launched, and its outputs come with the next call).
        On an exception the in-flight step is forgotten (its device work is harmless)."""
        prev, self.inflight = self.inflight, None
        try:
            if isinstance(prev, VerifyInFlight):
                return self._after_verify(prev)
            if prev is not None:
                nxt = self._next(prev) if self.active else None
                if nxt is not None:
                    self.inflight = self._launch(*nxt)
                return self._land(prev)
            batch = self.engine.scheduler.schedule()
            if batch is None:
                self.engine.step_clock.reset()  # idle (spec/policy.py StepClock)
                return self.engine.flush_outputs()
            if batch.phase is Phase.DECODE and self.active and self._can_launch(batch.reqs) \
                    and self.graphs.bucket(batch) is not None:
                self.inflight = self._launch(batch, None)
                return self.engine.flush_outputs()  # a verify step's, while this one runs
            if self.enabled and self.verify.can_launch(batch):
                self.inflight = self.verify.launch(batch)
                return self.engine.flush_outputs()
            return self.engine.run_batch(batch)
        except BaseException:
            self.inflight = None
            raise

    def _after_verify(self, prev: VerifyInFlight) -> list[RequestOutput]:
        """Launch the verify step chained behind `prev` when it may be, then land `prev`."""
        nxt = self.verify.launch_chained(prev) if self.enabled else None
        self.inflight = nxt
        outputs = self.verify.land(prev)
        if nxt is not None:
            live = [r for r in nxt.batch.reqs if not r.finished]
            if not live:
                self.inflight = None  # only discarded rows: nothing will land
            for req in live:  # prev's commit reset them; nxt's rows are provisional again
                req.widen_pending(nxt.batch.rows_per_req - 1)
        return outputs

    # ---- launch -------------------------------------------------------------------------
    @staticmethod
    def _can_launch(reqs: list[Req]) -> bool:
        return all(not r.in_prefill and overlappable(r) for r in reqs)

    def _next(self, prev: InFlight) -> tuple[Batch, DeviceTokens] | None:
        """The decode batch to launch behind `prev` and its device inputs, or None: a prefill
        or an admission is due, a row cannot overlap, or no graph bucket holds the batch (the
        caller lands `prev`; the next call schedules synchronously). Admits what fits first."""
        sched = self.engine.scheduler
        sched.admit()
        if not self._can_launch(sched.running):
            return None
        rows = {r.rid: i for i, r in enumerate(prev.batch.reqs)}
        if any(r.rid not in rows for r in sched.running):
            return None  # joined decode without a prefill step in between: cannot happen
        reqs = [r for r in sched.running if not finishes_by_length(r)]
        if not reqs:
            return None
        if sched.choose_drafts is not None and sched.choose_drafts(reqs) > 0:
            return None  # the policy wants a verify step: it runs synchronously
        starts = [r.device_len + r.ahead for r in reqs]
        batch = Batch(Phase.DECODE, reqs, [1] * len(reqs))
        if self.graphs.bucket(batch, starts) is None:
            return None
        for req, start in zip(reqs, starts):  # within what admission reserved
            sched.ensure_pages(req, start + 1)
        order = [rows[r.rid] for r in reqs]
        # the usual step feeds the previous one's rows in their order: a slice, nothing staged
        index = None if order == list(range(len(order))) \
            else to_device(order, torch.long, self.engine.device)
        return batch, DeviceTokens(starts, prev.tokens, index)

    def _launch(self, batch: Batch, device_tokens: DeviceTokens | None) -> InFlight:
        """Replay `batch`'s graph, sample on the device and start the copy of the tokens."""
        spec = self.engine.spec
        launched_at = time.perf_counter()
        keep_hidden = spec is not None and spec.wants_hidden
        out = self.graphs.forward(batch, keep_hidden, device_tokens=device_tokens)
        assert out is not None, "the caller checked the bucket"
        rows = [SamplingRow(r.params, r.prompt_ids, r.output_ids, r.sample_seed, ahead=r.ahead)
                for r in batch.reqs]
        st = SamplingTensors.build(rows, out.logits.shape[-1], out.logits.device)
        tokens = sample(out.logits, st, out.greedy)
        for req in batch.reqs:
            req.launch_ahead()
        if spec is not None:  # every row is ahead of the host now (see the module doc)
            spec.on_forward(batch, out.hidden)
        host, event = self._copies.start(tokens)
        self.launched_steps += 1
        self.launched_rows += batch.size
        self.overlapped_steps += device_tokens is not None
        return InFlight(batch, tokens, host, event, launched_at)

    # ---- land ---------------------------------------------------------------------------
    def _land(self, prev: InFlight) -> list[RequestOutput]:
        """Wait for `prev`'s tokens, commit them and return its outputs (requests finished
        before it landed, aborted or stopped one step earlier, are skipped). Forgets the
        step just launched if every one of its requests finished here."""
        if prev.event is not None:
            prev.event.synchronize()
        tokens = prev.host.tolist()
        batch = prev.batch
        for req in batch.reqs:
            req.land_ahead()
        self.discarded_rows += sum(r.finished for r in batch.reqs)
        outputs = self.commit_landed(batch, [[t] for t in tokens], prev.launched_at)
        if self.inflight is not None and all(r.finished for r in self.inflight.batch.reqs):
            self.inflight = None  # only discarded rows: nothing will land
        return outputs

    def commit_landed(self, batch: Batch, rows: list[list[int]], launched_at: float,
                      commit_rows: Callable[[list[int]], None] | None = None
                      ) -> list[RequestOutput]:
        """A step of `batch` launched at `launched_at` (time.perf_counter()) landed with
        rows[i] the tokens of batch.reqs[i]: commit them (Scheduler.process; requests that
        finished before it landed are skipped), count and log the step, and return its
        outputs. Its period (from the previous landing of a decode or verify step, or from
        its launch after a prefill step, to now: StepClock) goes to the policy as its cost
        beside the other kind's."""
        eng = self.engine
        live = [r for r in batch.reqs if not r.finished]
        before = {r.rid: len(r.output_ids) for r in live}
        sampled = {r.rid: row for r, row in zip(batch.reqs, rows) if not r.finished}
        eng.scheduler.process(batch, sampled, commit_rows)
        eng.num_steps += 1
        if eng.policy is not None:
            eng.policy.on_step(batch.rows_per_req - 1, batch.size,
                               eng.step_clock.landed(launched_at))
        eng.log_step(batch)
        return eng.emit(live, {r.rid: r.output_ids[before[r.rid]:] for r in live})
