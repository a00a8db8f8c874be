"""The MTP graph step captured and replayed on a CUDA device: speculation through it keeps the
tokens of plain decoding, and its drafts are the eager proposer's.

On the GPU the graph attends through the paged-attention kernel and the eager proposer through
gather + SDPA: fp32 results differ in the last bits, so a draft may differ where the head's top
two logits are within that noise; the test allows a small share of such drafts (a wrong KV
write or a wrong length would change most of them).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05
K = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpumtp") / "m", "qwen3_5_text",
                                    seed=8, with_mtp=True, linear_key_head_dim=32,
                                    linear_value_head_dim=32))


def make(ckpt: str, **kw) -> LLM:
    kw = dict(device="cuda", dtype="float32", num_pages=1024, page_size=16,
              max_running_reqs=8) | kw
    return LLM(ckpt, **kw)


def spec(ckpt: str, graphs: bool, policy: str = "fixed", **kw) -> LLM:
    return make(ckpt, speculative_algorithm="mtp", speculative_num_steps=K,
                speculative_policy=policy, mtp_cuda_graphs=graphs, **kw)


def record_drafts(llm: LLM) -> dict[tuple[int, ...], list[int]]:
    runtime, seen = llm.engine.spec, {}
    propose = runtime.propose

    def recording(batch):
        propose(batch)
        drafts = (batch.draft_tensor.tolist() if batch.draft_tensor is not None
                  else batch.draft_ids)
        for req, d, n in zip(batch.reqs, drafts, batch.num_drafts):
            seen[tuple(req.all_ids)] = d[:n]

    runtime.propose = recording
    return seen


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    batch = [tokens(n, seed=n + 3) for n in (5, 60, 130, 17, 300)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (24, 9, 16, 30, 12)]
    return batch, params


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_gpu_mtp_graphs_keep_plain_greedy_tokens(ckpt, policy):
    batch, params = workload()
    plain = [o.token_ids for o in make(ckpt).generate(batch, params)]
    llm = spec(ckpt, graphs=True, policy=policy)
    on = [o.token_ids for o in llm.generate(batch, params)]
    # a second turn: draft KV written by the graph comes back from the prefix cache
    follow = [p + o + tokens(4, seed=1) for p, o in zip(batch, on)]
    plain2 = [o.token_ids for o in make(ckpt).generate(follow, params)]
    on2 = [o.token_ids for o in llm.generate(follow, params)]
    graphs = llm.engine.spec.proposer.graphs
    assert graphs is not None and graphs.capture and graphs.steps > 0
    if policy == "fixed":
        assert graphs.steps > 10
    for prompt, p, a, b in zip(batch + follow, params * 2, plain + plain2, on + on2):
        ref = reference_greedy(ckpt, prompt, p.max_tokens)
        assert_same_runs(b, a, ref, f"mtp graphs ({policy}) len {len(prompt)}", eps=GPU_EPS)
    assert_drained(llm.engine)


def test_gpu_mtp_graph_drafts_equal_the_eager_proposer(ckpt):
    batch, params = workload()
    eager, graph = spec(ckpt, graphs=False), spec(ckpt, graphs=True)
    want, got = record_drafts(eager), record_drafts(graph)
    for llm in (eager, graph):
        pattern = itertools.cycle([K, K, 0, K, 0, 0, 0, 0, 0, K])
        llm.engine.scheduler.choose_drafts = lambda reqs, p=pattern: next(p)
        outs = llm.generate(batch, params)
        llm.generate([p + o.token_ids for p, o in zip(batch, outs)], params)
    assert graph.engine.spec.proposer.graphs.steps > 5
    common = want.keys() & got.keys()
    assert len(common) > 30
    differ = sum(got[key] != want[key] for key in common)
    assert differ <= 0.03 * len(common), f"{differ} of {len(common)} draft rows differ"
    assert_drained(graph.engine)


def test_gpu_sampled_and_greedy_requests_together_through_mtp_graphs(ckpt):
    batch, _ = workload()
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=16,
                             ignore_eos=True) for i in range(len(batch))]
    llm = spec(ckpt, graphs=True)
    outs = llm.generate(batch, params)
    plain = make(ckpt).generate(batch, params)
    for i, (prompt, a, b) in enumerate(zip(batch, plain, outs)):
        assert len(b.token_ids) == 16
        if params[i].temperature == 0.0:
            ref = reference_greedy(ckpt, prompt, 16)
            assert_same_runs(b.token_ids, a.token_ids, ref, f"greedy len {len(prompt)}",
                             eps=GPU_EPS)
    assert llm.engine.spec.proposer.graphs.steps > 0
    assert_drained(llm.engine)


def test_gpu_overlapped_plain_steps_between_mtp_verify_steps_keep_plain_tokens(ckpt):
    """Plain decode steps launched ahead of the host (overlap scheduling through the decode
    graphs) between synchronous verify steps, the MTP catch-up deferred to the verify."""
    from test_policy import PatternPolicy

    batch, params = workload()
    plain = [o.token_ids for o in make(ckpt).generate(batch, params)]
    llm = spec(ckpt, graphs=True, policy="adaptive")
    eng = llm.engine
    policy = PatternPolicy(K, "vvdddddvdd").install(eng)
    outs = [o.token_ids for o in llm.generate(batch, params)]
    # every verify step's drafts came from one replay (4 of them on this workload on the CPU)
    verify_steps = sum(k > 0 for k in policy.seen)
    assert eng.overlap.overlapped_steps > 5 and verify_steps >= 3
    assert eng.spec.proposer.graphs.steps == verify_steps
    assert eng.decode_graphs.graph_steps > 0
    for prompt, p, a, b in zip(batch, params, plain, outs):
        ref = reference_greedy(ckpt, prompt, p.max_tokens)
        assert_same_runs(b, a, ref, f"overlapped mtp len {len(prompt)}", eps=GPU_EPS)
    assert_drained(eng)


def test_gpu_the_hidden_ring_gives_the_head_the_rows_a_clone_gives(ckpt, monkeypatch):
    """The plain decode graphs' hidden-state ring (engine/cuda_graph.py), written by the
    captured replays, feeds the MTP head's eager catch-ups (every second step launched
    ahead, AHEAD_CAP 2) bitwise the rows that a clone after each replay feeds them; the ring
    is 18 steps long and wraps many times."""
    from test_policy import PatternPolicy

    from deltaserve.spec.mtp import proposer

    monkeypatch.setattr(proposer, "AHEAD_CAP", 2)
    batch, _ = workload()
    # long enough for the ring to wrap twice (the shared workload's 30 tokens launched 28)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (96, 40, 64, 110, 50)]

    def run(ring: bool):
        llm = spec(ckpt, graphs=True, policy="adaptive")
        eng = llm.engine
        assert eng.decode_graphs.ring_steps == 2 + 2 * (K + 1) + 8
        if not ring:
            eng.decode_graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, 1,
                                            eng.max_model_len)
        PatternPolicy(K, "vddddddddd").install(eng)
        head, seen = eng.spec.proposer.head, []
        forward = head.forward
        head.forward = lambda ids, hidden, ctx, **kw: (seen.append(hidden.clone()),
                                                       forward(ids, hidden, ctx, **kw))[1]
        return [o.token_ids for o in llm.generate(batch, params)], seen, eng

    want, want_rows, _ = run(False)
    got, got_rows, eng = run(True)
    assert eng.overlap.launched_steps > 2 * eng.decode_graphs.ring_steps
    assert got == want and len(got_rows) == len(want_rows) > 10
    assert all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))
    assert_drained(eng)


def test_gpu_a_deferred_catch_up_never_waits_for_the_device(ckpt, monkeypatch):
    """The eager catch-up of the rows that steps launched ahead left (every AHEAD_CAP such
    steps, and before a verify's replay: `keep` > 0) makes no host sync: a sync there would
    drain the overlap pipeline. Each such call runs under sync debug mode "error"."""
    from test_policy import PatternPolicy

    from deltaserve.spec.mtp import proposer

    monkeypatch.setattr(proposer, "AHEAD_CAP", 3)
    batch, params = workload()
    plain = [o.token_ids for o in make(ckpt).generate(batch, params)]
    llm = spec(ckpt, graphs=True, policy="adaptive")
    eng = llm.engine
    PatternPolicy(K, "vdddddddddd").install(eng)
    prop, calls = eng.spec.proposer, []
    catch_up = prop._catch_up

    def strict(reqs, keep=0):
        if not keep:
            return catch_up(reqs, keep)
        torch.cuda.set_sync_debug_mode("error")
        try:
            catch_up(reqs, keep)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(len(reqs))

    prop._catch_up = strict
    outs = [o.token_ids for o in llm.generate(batch, params)]
    assert len(calls) >= 3  # the deferred catch-ups ran, none of them synced
    for prompt, p, a, b in zip(batch, params, plain, outs):
        ref = reference_greedy(ckpt, prompt, p.max_tokens)
        assert_same_runs(b, a, ref, f"strict catch-up len {len(prompt)}", eps=GPU_EPS)
    assert_drained(eng)
