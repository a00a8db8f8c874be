"""TPEngine: LLMEngine over `tensor_parallel_size` processes, one rank each.

Every rank builds the same engine on its shard of the model (distributed/shard.py) and runs the
same scheduler, prefix cache and pools (each pool holding only the rank's heads); rank 0 is the
one the caller talks to. Rank 0 forwards each state-changing call to the workers as it happens
(distributed/worker.py) and, inside a step, what it alone decides: sampled or accepted tokens,
the drafts, the speculation policy's measured step time. Everything else is deterministic given
those, so snapshot copies, host-bank moves, replays and rollbacks stay in step on every rank
without being shipped. Any failed step, dead rank or collective timeout is fatal: the engine
stops its workers and raises RankFailure from then on (check_integrity too, so the server fails
the requests in flight and /health reports why).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import torch

from deltaserve.config import EngineConfig
from deltaserve.distributed import worker as w
from deltaserve.distributed.group import make_group, make_store
from deltaserve.distributed.shard import local_config, shard_model
from deltaserve.engine.llm_engine import LLMEngine, resolve_device_dtype

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req, SamplingParams

logger = logging.getLogger("deltaserve.distributed")


class TPEngine(LLMEngine):
    """rank 0 (the default: spawns ranks 1..size-1) or a worker rank (worker_main passes rank,
    port and link). Raises ValueError as LLMEngine, also when the model's heads or
    intermediate sizes do not split over tensor_parallel_size; RankFailure when a worker fails
    to start."""

    def __init__(self, cfg: EngineConfig, rank: int = 0, port: int = 0,
                 link: w.WorkerLink | None = None) -> None:
        cfg.validate()
        size, timeout = cfg.tensor_parallel_size, cfg.distributed_timeout_s
        self.rank, self.failure = rank, None
        self._nested = False  # inside a forwarded call (abort)
        self.link, self.workers = link, None
        device, _ = resolve_device_dtype(cfg)
        if device.type == "cuda":
            cfg.device = f"cuda:{rank}"  # one GPU per rank
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(rank)  # NCCL binds each rank's communicator to it
        if cfg.cuda_graphs and device.type == "cuda" and rank == 0:
            # TODO(issue 31, GPU): capture decode graphs per rank (NCCL all-reduce inside)
            logger.warning("tensor parallel: CUDA graphs are not captured yet at TP > 1")
        cfg.cuda_graphs = False
        if rank == 0:
            check_split(cfg)  # before any process starts
        store = make_store(rank, size, port, timeout)
        if rank == 0:
            self.workers = w.Workers(cfg, size, store.port, timeout)
        try:
            group_device = resolve_device_dtype(cfg)[0]
            if self.workers is None:
                self.group = make_group(store, rank, size, group_device, timeout)
            else:  # the rendezvous waits for every worker: notice one that dies first
                self.group = self.workers.rendezvous(
                    lambda: make_group(store, rank, size, group_device, timeout))
            super().__init__(cfg)
            if self.workers is not None:
                self.workers.collect(w.Ready)
        except BaseException:
            if self.workers is not None:
                self.workers.stop(graceful=False)
            raise
        if self.workers is not None:
            self.workers.watch(self._on_worker_exit)
        if self.spec is not None:
            self.spec = TPSpec(self.spec, self)
            self.policy = TPPolicy(self.policy, self)

    def _load_model(self, path: str):
        """The whole checkpoint, then this rank's shard of it; with load_format dummy the
        model is sharded while it has no storage (meta) and only the shard is drawn, so a
        model larger than one GPU is built (its weights differ from TP 1's: seed + rank)."""
        if self.cfg.load_format != "dummy":
            model = super()._load_model(path)
            shard_model(model, self.group)
            return model
        from deltaserve.model.config import ModelConfig
        from deltaserve.model.dummy import fill_dummy
        from deltaserve.model.prepare import prepare_weights
        from deltaserve.model.qwen3_5 import Model

        config = ModelConfig.from_pretrained(path)
        with torch.device("meta"):
            model = Model(config).to(self.dtype)
            shard_model(model, self.group)
        model = model.to_empty(device=self.device)
        model.rotary.reset_inv_freq()
        fill_dummy(model, self.cfg.seed + self.rank)
        prepare_weights(model)
        return model.requires_grad_(False).eval()

    # ---- calls forwarded to the workers (rank 0) ---------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: int | None = None) -> int:
        self._check_alive()
        rid = super().add_request(prompt_ids, params, rid)
        self._forward(w.AddRequest(list(prompt_ids), params, rid))
        return rid

    def add_forks(self, prompt_ids: list[int], params: list[SamplingParams],
                  rids: list[int] | None = None) -> list[int]:
        self._check_alive()
        rids = super().add_forks(prompt_ids, params, rids)
        self._forward(w.AddForks(list(prompt_ids), list(params), rids))
        return rids

    def abort(self, rid: int) -> bool:
        """Frees `rid` here; on a failed engine only here (the workers are gone). Only the
        outermost call is forwarded: aborting a fork's last choice aborts its parent from
        inside, and each worker's own call does the same."""
        if self._nested:
            return super().abort(rid)
        self._nested = True
        try:
            found = super().abort(rid)
        finally:
            self._nested = False
        if self.failure is None:
            self._forward(w.Abort(rid))
        return found

    def flush_cache(self) -> None:
        self._check_alive()
        super().flush_cache()
        self._forward(w.Flush())

    def step(self):
        self._check_alive()
        self._forward(w.Step())
        try:
            return super().step()
        except Exception as e:
            if self.rank != 0:
                raise
            # a dead peer's "connection reset" can come before its exit is visible
            why = self.workers.dead(w.DEATH_GRACE_S)
            self._fail(why or f"a step failed: {type(e).__name__}: {e}")
            raise w.RankFailure(self.failure) from e

    # ---- what rank 0 decides inside a step ------------------------------------------------
    def decide(self, kind: str, value=None):
        """rank 0: send `value` to the workers and return it; a worker: rank 0's value."""
        if self.rank == 0:
            self.workers.send(w.Decision(kind, value))
            return value
        return self.link.expect(kind)

    def _sample_rows(self, logits, rows, greedy) -> list[int]:
        tokens = super()._sample_rows(logits, rows, greedy) if self.rank == 0 else None
        return self.decide("tokens", tokens)

    # ---- health and pools -----------------------------------------------------------------
    def pool_report(self) -> w.PoolReport:
        """This rank's pool counters and its check_integrity outcome."""
        error = None
        try:
            LLMEngine.check_integrity(self)
        except AssertionError as e:
            error = str(e) or "check_integrity failed"
        bank = self.host_bank
        return w.PoolReport(self.rank, self.page_pool.num_allocated,
                            self.state_pool.num_allocated,
                            bank.num_allocated if bank is not None else 0, error)

    def rank_reports(self) -> list[w.PoolReport]:
        """Every rank's PoolReport, rank 0 first (rank 0 only). Raises RankFailure."""
        self._check_alive()
        self._forward(w.Check())
        try:
            return [self.pool_report(), *self.workers.collect(w.PoolReport)]
        except w.RankFailure as e:
            self._fail(str(e))
            raise

    def check_integrity(self) -> None:
        """LLMEngine's checks on every rank, and the same pool counts on every rank (they run
        the same commands). Raises RankFailure when the engine failed, AssertionError naming
        the rank otherwise."""
        reports = self.rank_reports()
        for r in reports:
            assert r.error is None, f"rank {r.rank}: {r.error}"
            for field in ("pages_allocated", "slots_allocated", "host_slots_allocated"):
                assert getattr(r, field) == getattr(reports[0], field), (
                    f"rank {r.rank} has {field} {getattr(r, field)}, rank 0 "
                    f"{getattr(reports[0], field)}: the ranks are out of step")

    def close(self) -> None:
        """Stop the workers (rank 0). The engine is unusable afterwards."""
        if self.workers is not None:
            graceful = self.failure is None
            # first: the watchdog then takes the workers' exits for the shutdown they are
            # (it logged "rank 1 exited with code -15" as an error on a plain Ctrl-C)
            if self.failure is None:
                self.failure = "the engine was closed"
            self.workers.stop(graceful=graceful)

    def __del__(self) -> None:
        workers = getattr(self, "workers", None)
        if workers is not None and not workers.stopped:
            try:  # at interpreter exit multiprocessing terminates daemon workers itself
                workers.stop(graceful=False)
            except Exception:
                pass

    def _forward(self, msg) -> None:
        if self.rank != 0:
            return
        dead = self.workers.dead()
        try:
            if dead is not None:
                raise w.RankFailure(dead)
            self.workers.send(msg)
        except w.RankFailure as e:
            self._fail(str(e))
            raise

    def _on_worker_exit(self, reason: str) -> None:
        """The watchdog thread: a worker exited (only a string is set here; the engine's own
        thread stops the others at its next call)."""
        if self.failure is None:
            self.failure = reason
            logger.error("tensor parallel: %s", reason)

    def _check_alive(self) -> None:
        if self.failure is not None:
            if self.workers is not None and not self.workers.stopped:
                self.workers.stop(graceful=False)
            raise w.RankFailure(self.failure)

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("tensor parallel: %s; stopping the workers", reason)
        self.workers.stop(graceful=False)


def check_split(cfg: EngineConfig) -> None:
    """Raise ValueError when the checkpoint's heads or intermediate sizes do not split over
    cfg.tensor_parallel_size ranks, or engine/preflight.py refuses the config (read from
    config.json alone)."""
    from deltaserve.engine.preflight import check_before_load, model_config

    mc = model_config(cfg)
    local_config(mc, cfg.tensor_parallel_size, 0)
    cfg.resolve_speculation()
    check_before_load(cfg, mc, *resolve_device_dtype(cfg))


class TPSpec:
    """The engine's SpecRuntime with rank 0's drafts and accepted tokens given to every rank
    (the proposer itself runs on every rank: MTP drafts are sharded forwards)."""

    def __init__(self, inner, engine: TPEngine) -> None:
        self.inner, self.engine = inner, engine
        self.num_steps, self.wants_hidden = inner.num_steps, inner.wants_hidden
        self._warned = False

    @property
    def proposer(self):
        return self.inner.proposer

    def propose(self, batch: Batch) -> None:
        self.inner.propose(batch)
        mine = (batch.draft_ids, batch.num_drafts)
        theirs = self.engine.decide("drafts", mine if self.engine.rank == 0 else None)
        if theirs != mine and not self._warned:
            self._warned = True  # the verify rows must be the same on every rank
            warnings.warn(f"rank {self.engine.rank} proposed other drafts than rank 0; "
                          "using rank 0's", RuntimeWarning, stacklevel=2)
        batch.draft_ids, batch.num_drafts = theirs

    def accept(self, batch: Batch, logits, greedy=None, accepted=None) -> dict[int, list[int]]:
        out = (self.inner.accept(batch, logits, greedy, accepted) if self.engine.rank == 0
               else None)
        return self.engine.decide("accepted", out)

    def on_forward(self, batch: Batch, hidden) -> None:
        self.inner.on_forward(batch, hidden)

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        self.inner.on_commit(batch, committed)

    def release(self, req: Req) -> None:
        self.inner.release(req)


class TPPolicy:
    """The speculation policy with rank 0's measured step seconds on every rank, so every
    rank's adaptive policy chooses the same k."""

    def __init__(self, inner, engine: TPEngine) -> None:
        self.inner, self.engine = inner, engine

    def choose(self, reqs: list[Req]) -> int:
        return self.inner.choose(reqs)

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        seconds = self.engine.decide("seconds", seconds if self.engine.rank == 0 else None)
        self.inner.on_step(k, batch_size, seconds)

    def on_verify(self, reqs: list[Req], committed: list[int]) -> None:
        self.inner.on_verify(reqs, committed)

    def release(self, req: Req) -> None:
        self.inner.release(req)
