"""Engines with and without overlap scheduling on one fixed-shape step, and a scripted driver.

On a CPU the decode graph runner runs its fixed-shape step eagerly (capture=False, as in
test_graph_step.py), so the overlap path (engine/overlap.py) runs here exactly as on a GPU,
only without asynchrony: every equality it must keep is checked on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from deltaserve.engine.llm_engine import LLMEngine


def make_engine(path: str, overlap: bool, device: str = "cpu", **kw) -> LLMEngine:
    """An fp32 engine, overlap scheduling on or off (--disable-overlap-schedule). On a CPU its
    decode steps take the fixed-shape (graph) path run eagerly; on CUDA real graphs."""
    kw.setdefault("num_pages", 512)
    kw.setdefault("page_size", 16)
    kw.setdefault("max_running_reqs", 8)
    eng = LLM(path, device=device, dtype="float32", overlap_schedule=overlap, **kw).engine
    if device == "cpu":
        eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, 1, eng.max_model_len,
                                 capture=False)
    assert eng.graphs is not None
    return eng


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reason: str | None = None
    logprobs: list = field(default_factory=list)


Action = Callable[[LLMEngine, dict[int, Result]], None]


def add(rid: int, prompt: list[int], params: SamplingParams) -> Action:
    def act(eng: LLMEngine, results: dict[int, Result]) -> None:
        copy = SamplingParams(**{f.name: getattr(params, f.name) for f in fields(params)})
        eng.add_request(list(prompt), copy, rid=rid)
        results[rid] = Result()
    return act


def abort(rid: int) -> Action:
    def act(eng: LLMEngine, results: dict[int, Result]) -> None:
        eng.abort(rid)
        results[rid].reason = "abort"
    return act


def drive(eng: LLMEngine, script: dict[int, list[Action]]) -> dict[int, Result]:
    """Call eng.step() until nothing is left, running script[k]'s actions before call k;
    collect each request's outputs. Asserts that no request gets an output after the one
    that finished it (an overlapped row past a finish must never be emitted)."""
    results: dict[int, Result] = {}
    k = 0
    while eng.has_unfinished() or k <= max(script, default=0):
        for act in script.get(k, []):
            act(eng, results)
        for out in eng.step():
            res = results[out.rid]
            assert res.reason is None, f"request {out.rid}: an output after it finished"
            res.tokens += out.new_token_ids
            res.text += out.new_text
            res.logprobs += out.new_logprobs or []
            if out.finished:
                res.reason = out.finish_reason
        k += 1
        assert k < 10_000, "the engine never went idle"
    return results


def first_new(out: list[int], j: int) -> int:
    """The first index >= j of `out` whose token does not occur before it (a stop token
    there ends the request at exactly that output)."""
    return next(i for i in range(j, len(out)) if out[i] not in out[:i])


def stop_at(make: Callable[[], LLMEngine], prompt: list[int], params: SamplingParams,
            j: int, exact: bool = False) -> SamplingParams | None:
    """`params` with a stop token that ends the request at output token j', the first index
    >= j whose token did not come earlier (found by a run on the engine `make()` builds);
    exact: None unless j' == j."""
    (res,) = drive(make(), {0: [add(0, prompt, params)]}).values()
    out = res.tokens
    first = first_new(out, j)
    if exact and first != j:
        return None
    return dataclasses.replace(params, stop_token_ids=[out[first]])


def stop_on_grid(make: Callable[[], LLMEngine], prompt: list[int], n: int,
                 seeds: range) -> SamplingParams:
    """Seeded sampling params (the first seed of `seeds` that allows it) whose stop token
    ends the request at exactly output token n - 1, so len(prompt) + n - 1 tokens are
    processed at its finish."""
    for seed in seeds:
        params = stop_at(make, prompt, SamplingParams(temperature=0.9, seed=seed,
                                                      max_tokens=n + 20, ignore_eos=True),
                         n - 1, exact=True)
        if params is not None:
            return params
    raise AssertionError(f"no seed in {seeds} samples a new token at output {n - 1}")


def snapshots(eng: LLMEngine) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{depth: (recurrent, conv) copies} of every device snapshot in the prefix cache."""
    pool = eng.state_pool
    return {n.depth: (pool.recurrent[:, n.snapshot_slot].clone(),
                      pool.conv[:, n.snapshot_slot].clone())
            for n in eng.prefix_cache.tree.nodes() if n.snapshot_slot is not None}
