"""LLMEngine: the synchronous engine behind `LLM` and the server (not thread-safe)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from deltaserve.config import EngineConfig
from deltaserve.core import Batch, FinishReason, Phase, Req, SamplingParams
from deltaserve.engine.caches import build_caches
from deltaserve.engine.cuda_graph import build_graph_runners
from deltaserve.engine.forks import ForkGroups, parent_params
from deltaserve.engine.grammar import GrammarBackend
from deltaserve.engine.healing import TokenHealer, mask_healing
from deltaserve.engine.logprobs import TextOffsets, TokenLogprob, step_logprobs
from deltaserve.engine.model_runner import ModelRunner
from deltaserve.engine.overlap import OverlapScheduler
from deltaserve.engine.preflight import check_before_load, resolve_device_dtype
from deltaserve.engine.requests import new_req
from deltaserve.engine.sampling import SamplingRow, sample_rows
from deltaserve.engine.spec_protocol import load_spec_runtime
from deltaserve.engine.status import cache_status, check_integrity, engine_metrics, log_step
from deltaserve.model.config import ModelConfig
from deltaserve.ops._ext import KERNEL_HEAD_DIMS
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.spec.policy import StepClock, build_policy

logger = logging.getLogger("deltaserve.engine")


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals, except the counts)."""

    rid: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[TokenLogprob] | None = None  # one per new token (params.logprobs set)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer (transformers fast tokenizer), or None when it has none.

    Its model_max_length is lifted: the engine refuses a prompt past max_model_len with its
    own error, and transformers' "longer than the specified maximum sequence length" warning
    printed before that error would only mislead."""
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 2**62
    return tokenizer


class LLMEngine:
    """Loads a model, sizes the caches, and runs scheduler steps.

    Raises ValueError for a bad config, an unknown model type or a broken checkpoint
    (from the loader, naming the tensor).
    """

    failure: str | None = None  # why the engine can serve no more (tensor parallel: a rank died)

    def __init__(self, cfg: EngineConfig) -> None:
        cfg.validate()
        cfg.resolve_speculation()
        if cfg.radix_lookahead is None:
            # the MTP head's draft KV at position i depends on t_{i+1}
            cfg.radix_lookahead = cfg.speculative_algorithm == "mtp"
        self.cfg = cfg
        if cfg.model is None:
            from deltaserve.default_model import default_model_path

            path = default_model_path()
        else:
            path = cfg.model
        self.model_path = path
        self.model_name = cfg.model or "deltaserve-default"
        self.device, self.dtype = resolve_device_dtype(cfg)
        torch.manual_seed(cfg.seed)
        # the context and the caches, from config.json and the flags, before the weights load
        self.max_model_len = check_before_load(cfg, ModelConfig.from_pretrained(path),
                                               self.device, self.dtype)
        self.model = self._load_model(path)
        self.tokenizer = load_tokenizer(path)
        mc = self.model.config
        if self.device.type == "cuda" and mc.linear_key_head_dim not in KERNEL_HEAD_DIMS:
            logger.warning("GDN head_k_dim %d has no compiled kernel (compiled: %s): decode and "
                           "verify run the torch reference, far slower", mc.linear_key_head_dim,
                           KERNEL_HEAD_DIMS)
        self.eos_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        (self.kv, self.draft_kv, self.page_pool, self.state_pool, self.host_bank,
         self.prefix_cache) = build_caches(cfg, mc, self.max_model_len, self.device, self.dtype)
        self.runner = ModelRunner(self.model, self.kv, self.state_pool, self.device,
                                  cfg.max_running_reqs, cfg.decode_rows_per_req,
                                  draft_kv=self.draft_kv)
        self.spec = load_spec_runtime(cfg, self.model, self.runner)
        # adaptive: each decode step verifies k drafts or runs a plain decode (spec/policy.py)
        self.policy = (build_policy(cfg.speculative_policy, cfg.speculative_num_steps)
                       if self.spec is not None else None)
        # verify graphs with speculation, else decode graphs; decode_graphs: the plain decode
        # steps an adaptive policy picks
        self.graphs, self.decode_graphs = build_graph_runners(cfg, self.model, self.runner,
                                                              self.spec, self.max_model_len)
        self.scheduler = Scheduler(cfg, self.page_pool, self.state_pool, self.prefix_cache,
                                   self.eos_ids,
                                   on_release=self._release if self.spec else None,
                                   choose_drafts=self.policy.choose if self.policy else None)
        longest = self.scheduler.max_request_len()
        if longest < self.max_model_len:
            # vLLM refuses to start here; a pool below the context still serves shorter requests
            logger.warning("the longest request the KV page pool can hold is %d tokens, less "
                           "than the context length %d: longer ones are refused (%s, or lower "
                           "--max-model-len)", longest, self.max_model_len,
                           self.scheduler.pool_hint())
        # verify counters: requests' verifies, their committed rows and drafts, verify steps
        self.spec_steps = self.spec_committed = self.spec_drafted = self.spec_verify_steps = 0
        self._rids = itertools.count()
        self._reqs: dict[int, Req] = {}
        self.num_steps = 0
        self.generated_tokens = 0
        self.step_clock = StepClock()  # each decode / verify step's cost for the policy
        self._grammar: GrammarBackend | None = None  # built by the first structured request
        self._healer: TokenHealer | None = None  # built by the first token-healing request
        self.forks = ForkGroups(self._queue)
        # decode steps launched ahead (engine/overlap.py): used where decode graphs exist
        # (with speculation: the adaptive policy's plain decode steps)
        self.overlap = (OverlapScheduler(self) if cfg.overlap_schedule
                        and cfg.tensor_parallel_size == 1 else None)
        self._deferred: tuple | None = None  # emit()'s arguments for a verify step's outputs
        if cfg.overlap_verify and (self.overlap is None or not self.overlap.verify.on):
            logger.warning("--overlap-verify has no effect here: it needs CUDA graphs, the MTP "
                           "proposer's graphs and overlap scheduling at tensor parallel size 1")
        if cfg.capture_graphs_at_start:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Every CUDA graph of every batch bucket now (GraphRunner.capture_all)."""
        proposer = getattr(self.spec, "proposer", None)
        runners = [self.graphs, self.decode_graphs, getattr(proposer, "graphs", None)]
        runners = [g for g in runners if g is not None and g.capture]
        if not runners:
            return
        start = time.perf_counter()
        n = sum(g.capture_all() for g in runners)
        logger.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - start)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: int | None = None) -> int:
        """Queue a request; raises ValueError for bad parameters (stop token ids outside the
        vocabulary too) or a prompt that is empty, has ids outside the vocabulary, or leaves
        no room to generate within the context."""
        req = self._new_req(prompt_ids, params, rid)
        self._queue(req)
        return req.rid

    def add_forks(self, prompt_ids: list[int], params: list[SamplingParams],
                  rids: list[int] | None = None) -> list[int]:
        """Queue len(params) choices of one prompt, prefilled once (engine/forks.py); returns
        their rids. Raises ValueError as add_request, before any choice is queued."""
        choices = [self._new_req(prompt_ids, p, None if rids is None else rids[i])
                   for i, p in enumerate(params)]
        if len({r.rid for r in choices}) != len(choices):
            raise ValueError("the choices' request ids must differ")
        for req in choices:
            self.scheduler.check_fits(req)
        if len(choices) > 1 and self.cfg.enable_prefix_cache \
                and len(prompt_ids) > self.prefix_cache.snapshot_step:
            parent = self._new_req(prompt_ids, parent_params(), self.forks.new_parent_rid())
            self.forks.hold(parent.rid, choices)
            self._queue(parent)
        else:
            for req in choices:
                self._queue(req)
        return [r.rid for r in choices]

    def _new_req(self, prompt_ids: list[int], params: SamplingParams, rid: int | None) -> Req:
        rid = next(self._rids) if rid is None else rid
        if rid in self._reqs or self.forks.is_held(rid):
            raise ValueError(f"request id {rid} is already in use")
        return new_req(prompt_ids, params, rid, self.model.config.vocab_size,
                       self.max_model_len, self.tokenizer, lambda: self.grammar,
                       lambda: self.healer)

    def _queue(self, req: Req) -> None:
        self.scheduler.add(req)
        self._reqs[req.rid] = req

    def abort(self, rid: int) -> bool:
        """Abort `rid` (waiting, running or held for its fork parent) and free its pages and
        slots (the parent's too once none of its choices is left)."""
        if self.forks.is_held(rid):
            parent = self.forks.drop(rid)
            if parent is not None:
                self.abort(parent)
            return True
        req = self.scheduler.abort(rid)
        self._reqs.pop(rid, None)
        return req is not None

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend (built on first use: xgrammar reads the vocabulary).
        Raises ValueError when the model has no tokenizer."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model "
                                 "has none")
            self._grammar = GrammarBackend(self.tokenizer, self.model.config.vocab_size,
                                           self.eos_ids)
        return self._grammar

    @property
    def healer(self) -> TokenHealer | None:
        """The tokenizer's token-healing prefix table (built on first use); None without a
        tokenizer (token ids only: healing is then off)."""
        if self._healer is None and self.tokenizer is not None:
            self._healer = TokenHealer(self.tokenizer, self.model.config.vocab_size)
        return self._healer

    @property
    def max_request_len(self) -> int:
        """Prompt + output tokens one request may reach: the context length, or less when the
        KV page pool is smaller (a request reserves its pages at admission)."""
        return min(self.max_model_len, self.scheduler.max_request_len())

    def has_unfinished(self) -> bool:
        return self._deferred is not None or self.scheduler.has_unfinished()

    def flush_cache(self) -> None:
        self.prefix_cache.flush()

    def check_integrity(self) -> None:
        """No page, GDN state slot or host-bank slot leaked (engine/status.check_integrity).
        Raises AssertionError naming what is wrong."""
        check_integrity(self)

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; return the outputs of requests that advanced. With
        overlap scheduling (engine/overlap.py) a decode step's outputs come with the next
        call, which launches the step after it first."""
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.scheduler.schedule()
        if batch is None:
            self.step_clock.reset()  # idle: the next step's cost starts at its own start
            return self.flush_outputs()
        return self.run_batch(batch)

    def run_batch(self, batch: Batch) -> list[RequestOutput]:
        """Run a scheduled batch synchronously (forward, grammar and healing masks, sampling,
        the tokens copied back, commit) and return the outputs of requests that advanced."""
        start = time.perf_counter()
        spec = self.spec
        if batch.phase is Phase.VERIFY:
            spec.propose(batch)
        keep_hidden = spec is not None and spec.wants_hidden
        out = None
        graphs = self.decode_graphs if batch.phase is Phase.DECODE and spec else self.graphs
        if graphs is not None and batch.phase is not Phase.PREFILL:
            out = graphs.forward(batch, keep_hidden)
        if out is None:
            out = self.runner.forward(batch, keep_hidden)
        early = self.flush_outputs()  # the last verify step's, while this forward runs
        if spec is not None:
            spec.on_forward(batch, out.hidden)
        constrained = [r for r in batch.reqs if r.grammar is not None]
        greedy = out.greedy  # the graph's argmax: of the logits before any grammar mask
        if constrained:  # after the forward (a graph's output buffer), before sampling
            self._grammar.mask(batch, out.logits, out.owners)
            greedy = None
        if mask_healing(out.logits, batch, out.owners):  # tokens that keep to the backed-up
            greedy = None  # prompt token's text
        before = {r.rid: len(r.output_ids) for r in batch.reqs}
        if batch.phase is Phase.VERIFY:
            sampled = spec.accept(batch, out.logits, greedy, out.accepted)
            self.scheduler.process(batch, sampled,
                                   commit_rows=lambda counts: self._commit_verify(batch, counts))
        else:
            rows = [SamplingRow(r.params, r.prompt_ids, r.output_ids, r.sample_seed)
                    for r in out.owners]
            tokens = self._sample_rows(out.logits, rows, greedy) if rows else []
            sampled = {}
            for req, tok in zip(out.owners, tokens):
                sampled.setdefault(req.rid, []).append(tok)
            self.scheduler.process(batch, sampled)
        self.num_steps += 1
        if batch.phase is Phase.PREFILL:
            self.step_clock.reset()
        elif self.policy is not None:
            self.policy.on_step(batch.rows_per_req - 1, batch.size, self.step_clock.landed(start))
        self.log_step(batch)
        new_by_rid = {r.rid: r.output_ids[before[r.rid]:] for r in batch.reqs}
        logprobs = step_logprobs(out.logits, out.owners, new_by_rid)
        for req in constrained:
            GrammarBackend.advance(req, new_by_rid[req.rid])
        if batch.phase is Phase.VERIFY:
            self._deferred = (batch.reqs, new_by_rid, logprobs)
            return early
        return early + self.emit(batch.reqs, new_by_rid, logprobs)

    def flush_outputs(self) -> list[RequestOutput]:
        """The outputs of the last verify step, which run_batch leaves to the next step's call:
        their detokenizing and building (40% of a batch-32 MTP verify step's host work,
        bench_step_host.py) then runs while that step's forward does, off the critical path.
        Every step flushes them before it commits anything (run_batch after its forward, the
        overlap scheduler when it launches or finds nothing to run), so outputs stay in order."""
        d, self._deferred = self._deferred, None
        if d is None:
            return []
        # a request aborted since that step gets nothing more (abort() already forgot it)
        reqs = [r for r in d[0] if r.finish_reason is not FinishReason.ABORT]
        return self.emit(reqs, *d[1:])

    def emit(self, reqs: list[Req], new_by_rid: dict[int, list[int]],
             logprobs: dict[int, list[TokenLogprob]] | None = None) -> list[RequestOutput]:
        """The outputs of `reqs` after a step committed `new_by_rid[rid]` to each (those with
        no new token that did not finish are left out); finished requests are forgotten, and
        fork parents' outputs turned into their choices' admission (engine/forks.py)."""
        outputs = []
        now = time.monotonic()
        for req in reqs:
            new_ids, finished = new_by_rid[req.rid], req.finished
            if not new_ids and not finished:
                continue
            if new_ids and req.first_token_time is None:
                req.first_token_time = now
            self.generated_tokens += len(new_ids)
            entries = logprobs.get(req.rid) if logprobs else None
            if entries and self.tokenizer is not None:
                if req.text_offsets is None:
                    req.text_offsets = TextOffsets(
                        self.tokenizer, req.healing.removed_text if req.healing else "")
                req.text_offsets.assign(entries)
            outputs.append(RequestOutput(
                rid=req.rid, new_token_ids=new_ids,
                new_text=req.detok.take_new_text(final=finished),
                finished=finished,
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                # the user's prompt and the tokens of new text (healing backed one prompt
                # token up and its first output tokens may only re-generate it)
                prompt_tokens=req.prompt_len + (req.healing is not None),
                completion_tokens=len(req.output_ids) - (
                    req.healing.silent(req.output_ids) if req.healing is not None else 0),
                cached_tokens=req.cached_len,
                new_logprobs=entries))
            if finished:
                self._reqs.pop(req.rid, None)
        return self.forks.on_outputs(outputs)

    def _load_model(self, path: str):
        from deltaserve.model.loader import load_model

        return load_model(path, self.dtype, self.device, load_format=self.cfg.load_format,
                          seed=self.cfg.seed)

    def _sample_rows(self, logits, rows: list[SamplingRow], greedy) -> list[int]:
        """One token per logits row (tensor parallel: rank 0 samples, distributed/engine.py)."""
        return sample_rows(logits, rows, greedy)

    def _commit_verify(self, batch, counts: list[int]) -> None:
        self.runner.commit_verify(counts)
        self.spec.on_commit(batch, counts)
        self.count_verify(batch, counts)

    def count_verify(self, batch, counts: list[int]) -> None:
        """A verify step kept counts[i] rows of request i: the policy's acceptance, the
        acceptance-length counters."""
        self.policy.on_verify(batch.reqs, counts)
        live = [c for c in counts if c > 0]
        self.spec_steps += len(live)
        self.spec_committed += sum(live)
        drafts = batch.num_drafts or [batch.rows_per_req - 1] * len(counts)
        self.spec_drafted += sum(n for n, c in zip(drafts, counts) if c > 0)
        self.spec_verify_steps += 1

    def _release(self, req: Req) -> None:
        self.spec.release(req)
        self.policy.release(req)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per request per verify step (accepted drafts + 1)."""
        return self.spec_committed / self.spec_steps if self.spec_steps else None

    def log_step(self, batch: Batch) -> None:
        log_step(self, batch)

    # ---- introspection ------------------------------------------------------------------
    def cache_status(self) -> dict:
        """Pools and prefix cache now (engine/status.py names every field)."""
        return cache_status(self)

    def metrics(self) -> dict[str, float]:
        """The Prometheus gauges and counters (engine/status.py)."""
        return engine_metrics(self)
