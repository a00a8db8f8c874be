"""Overlapped verify steps (engine/overlap_verify.py): an MTP verify step launched before the
previous one landed gives the synchronous steps' greedy tokens, token for token, also when a
request stops inside an accepted run (its chained row is discarded), is aborted mid-chain,
or resumes from the prefix cache; the cache keeps no snapshot of a state the chained launch
moved past the stop, and nothing leaks.

CPU, fp32, the embedded default model (its MTP head accepts about 3 of 3 drafts, so chained
steps commit 1 to 4 rows); the target's verify steps and the MTP step take their fixed-shape
(graph) paths run eagerly (capture=False), so the chained launch runs here as on a GPU, only
without asynchrony (tests/spec/test_gpu_overlap_verify.py replays real graphs).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from drained import assert_drained
from overlap_driver import abort, add, drive, first_new, snapshots

K = 3
OPENINGS = ["def is_prime(n):\n", "class Stack:\n    def push(self, item):\n",
            "import os\n\n\ndef walk(path):\n    \"\"\"Yield every file under path.\"\"\"\n",
            "def parse_args(argv):\n"]


def make(overlap_verify: bool, spec: bool = True, **kw) -> LLM:
    """A CPU engine with MTP speculation (fixed k = 3) whose verify and MTP steps take the
    fixed-shape path; overlap_verify on or off."""
    kw = dict(device="cpu", dtype="float32", num_pages=512, page_size=16,
              max_running_reqs=4) | kw
    if not spec:
        return LLM(None, **kw)
    llm = LLM(None, speculative_algorithm="mtp", speculative_num_steps=K,
              speculative_policy="fixed", overlap_verify=overlap_verify, **kw)
    eng = llm.engine
    eng.spec.use_graphs(eng.cfg.max_running_reqs, eng.max_model_len, capture=False)
    eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, K + 1, eng.max_model_len,
                             capture=False)
    return llm


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = make(False, spec=False).tokenizer
    return [tok.encode(text) for text in OPENINGS]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def record_chained_commits(llm: LLM) -> list[int]:
    """Rows kept per request by each verify step whose rows the next (chained) step's launch
    committed on the device."""
    spec, seen = llm.engine.spec, []
    commit = spec.on_chained_commit

    def counting(batch, counts):
        seen.extend(c for c in counts if c)
        commit(batch, counts)

    spec.on_chained_commit = counting
    return seen


def test_chained_verify_steps_give_plain_greedy_tokens(prompts):
    params = [greedy(m) for m in (41, 23, 30, 37)]
    want = [o.token_ids for o in make(False, spec=False).generate(prompts, params)]
    sync = make(False)
    assert [o.token_ids for o in sync.generate(prompts, params)] == want
    llm = make(True)
    commits = record_chained_commits(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    verify = llm.engine.overlap.verify
    assert verify.chained_steps >= 5 and verify.launched_steps > verify.chained_steps
    assert sync.engine.overlap.verify.launched_steps == 0
    # chained steps committed every count from 1 to k+1 (the rows start where they stopped)
    assert set(commits) == {1, 2, 3, 4}
    assert_drained(llm.engine)


def stops_inside_runs(prompts: list[list[int]]) -> list[SamplingParams]:
    """Per prompt a stop token that ends its greedy output at a new token 9..14 tokens in
    (inside a verify step's accepted run, with chained steps before it)."""
    free = [o.token_ids for o in make(False, spec=False).generate(
        prompts, [greedy(40)] * len(prompts))]
    out = []
    for i, toks in enumerate(free):
        j = first_new(toks, 9 + i)
        out.append(greedy(40, stop_token_ids=[toks[j]]))
    return out


def test_stops_inside_accepted_runs_and_an_abort_mid_chain(prompts):
    params = stops_inside_runs(prompts)
    script = {0: [add(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))],
              4: [abort(3)]}
    sync, llm = make(False), make(True)
    want, got = drive(sync.engine, script), drive(llm.engine, script)
    for rid in range(3):
        assert got[rid].tokens == want[rid].tokens
        assert got[rid].text == want[rid].text
        assert got[rid].reason == want[rid].reason == "stop"
        assert got[rid].tokens[-1] in params[rid].stop_token_ids
    assert got[3].reason == "abort"
    assert llm.engine.overlap.verify.chained_steps >= 3
    assert_drained(llm.engine)


def test_chains_go_on_without_the_requests_that_finished(prompts):
    """Requests that stop at different steps: the chain carries on over those still running
    (their rows gathered from the previous step's on the device), tokens unchanged."""
    params = [greedy(40, stop_token_ids=sp.stop_token_ids) if i % 2 else greedy(30 + 4 * i)
              for i, sp in enumerate(stops_inside_runs(prompts))]
    want = [o.token_ids for o in make(False, spec=False).generate(prompts, params)]
    llm = make(True)
    sizes = []
    launch = llm.engine.overlap.verify.launch_chained

    def recording(prev):
        nxt = launch(prev)
        if nxt is not None:
            sizes.append((prev.batch.size, nxt.batch.size))
        return nxt

    llm.engine.overlap.verify.launch_chained = recording
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert any(after < before for before, after in sizes), sizes
    assert_drained(llm.engine)


def stops_on_the_grid(prompts: list[list[int]], grid: int = 64) -> list[tuple]:
    """(prompt, params) pairs, prompts cut from `prompts` to lengths whose greedy output has a
    new token exactly where the request then holds `grid` tokens in KV: a stop there makes
    release consider a snapshot at that depth."""
    base = [t for p in prompts for t in p]
    cuts = [base[:n] for n in range(6, 48, 2)]
    free = [o.token_ids for o in make(False, spec=False).generate(cuts, [greedy(70)] * len(cuts))]
    out = []
    for p, toks in zip(cuts, free):
        j = grid - len(p)  # output j is the token fed at position grid: device_len = grid
        if toks[j] not in toks[:j]:
            out.append((p, greedy(70, stop_token_ids=[toks[j]])))
    assert len(out) >= 3, "too few prompt lengths stop on the grid"
    return out[:4]


def test_prefix_cache_turns_keep_exact_snapshots(prompts):
    """A first turn ends by stop tokens at a snapshot-grid depth, during chains; a second
    resumes each conversation from the cache: same tokens as the synchronous engine, and every
    GDN snapshot the cache holds equals the synchronous engine's at that depth (a state a
    chained launch moved past its stop is never kept)."""
    pairs = stops_on_the_grid(prompts)
    first_prompts, params = [p for p, _ in pairs], [sp for _, sp in pairs]
    sync, llm = make(False), make(True)
    ahead_at_release = []
    release = llm.engine.scheduler.release

    def recording(req):
        ahead_at_release.append(req.ahead)
        release(req)

    llm.engine.scheduler.release = recording
    runs = {}
    for name, eng in (("sync", sync), ("overlap", llm)):
        first = [o.token_ids for o in eng.generate(first_prompts, params)]
        # each sequence's KV is cached in whole pages: the snapshot at 64 is what a second
        # turn resumes from
        follow = [p + o + p[:5] for p, o in zip(first_prompts, first)]
        second = [o.token_ids for o in eng.generate(follow, [greedy(20)] * len(follow))]
        runs[name] = (first, second, snapshots(eng.engine))
    assert runs["overlap"][:2] == runs["sync"][:2]
    assert all(len(p) + len(o) - 1 == 64 for p, o in zip(first_prompts, runs["sync"][0]))
    # the synchronous engine resumed from its snapshots at 64; the chained one only where a
    # request finished with no chained step in flight (else its end state is not kept)
    assert sync.engine.scheduler.hit_tokens > 0
    assert any(ahead_at_release), "no request finished with a chained step in flight"
    want_snaps, got_snaps = runs["sync"][2], runs["overlap"][2]
    assert set(got_snaps) <= set(want_snaps)
    for depth, (rec, conv) in got_snaps.items():
        # equal up to fp32 rounding: the two engines prefill the second turn from different
        # snapshots (a state one token past its depth differs by orders of magnitude more)
        torch.testing.assert_close(rec, want_snaps[depth][0], rtol=0, atol=1e-4)
        torch.testing.assert_close(conv, want_snaps[depth][1], rtol=0, atol=1e-4)
    assert_drained(llm.engine)


@pytest.mark.parametrize("pattern", ["vvvd", "vvdddv"])
def test_chains_between_overlapped_plain_decode_steps(prompts, pattern):
    """A policy that puts plain decode steps (themselves launched ahead, engine/overlap.py)
    between runs of verify steps: a chain ends when the policy wants a plain step, the rows
    plain steps leave are caught up by the next verify's MTP step, and the tokens stay."""
    from test_policy import PatternPolicy

    params = [greedy(m) for m in (33, 21, 28, 35)]
    want = [o.token_ids for o in make(False, spec=False).generate(prompts, params)]
    llm = make(True)
    eng = llm.engine
    eng.decode_graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, 1, eng.max_model_len,
                                    capture=False)
    policy = PatternPolicy(K, pattern).install(eng)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert eng.overlap.verify.chained_steps > 0 and eng.overlap.overlapped_steps > 0
    assert 0 in policy.seen and K in policy.seen
    assert_drained(eng)


def test_overlap_verify_where_it_cannot_work_says_so(caplog):
    # a CPU device: no CUDA graphs, so verify steps run synchronously (and the log says why)
    with caplog.at_level("WARNING", logger="deltaserve.engine"):
        llm = LLM(None, device="cpu", dtype="float32", num_pages=64,
                  speculative_algorithm="mtp", overlap_verify=True)
    assert any("--overlap-verify has no effect here" in r.message for r in caplog.records)
    assert not llm.engine.overlap.verify.on
