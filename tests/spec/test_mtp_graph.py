"""The MTP proposer's fixed-shape graph step (catch-up + drafts in one step, spec/mtp/graph.py)
gives the eager proposer's drafts, and speculation through it reproduces plain greedy decoding
(CPU, fp32: the step runs uncaptured, capture=False; the gpu test replays real graphs).

The eager proposer is itself checked against an independent MTP head in test_mtp_proposer.py,
so equal drafts at every (request, length) mean the graph step reads and writes exact draft KV,
also the draft KV a later turn takes from the prefix cache.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner, hidden_ring_steps
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.accept import accept_greedy_rows
from deltaserve.spec.rejection import accept
from drained import assert_drained
from token_ids import random_tokens as tokens

K = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("mtpg") / "m", "qwen3_5_text",
                                    seed=8, with_mtp=True))


def make(ckpt: str, graphs: bool, static_target: bool = False, max_graph_reqs: int = 2,
         pattern: str | None = None, ring: bool = False, **kw) -> LLM:
    """An MTP engine; graphs: the proposer's fixed-shape step for batches of up to
    max_graph_reqs (larger ones run the eager proposer); static_target: the target's verify
    steps through the fixed-shape GraphRunner as well (drafts handed over on the device);
    pattern: a test_policy.PatternPolicy of verify ("v") and plain ("d") steps, the plain
    ones through fixed-shape decode steps (so the overlap scheduler runs them); ring: those
    steps hand out their hidden rows from the engine's hidden-state ring, not a clone."""
    kw = dict(device="cpu", dtype="float32", num_pages=512, page_size=4, max_running_reqs=4,
              speculative_algorithm="mtp", speculative_num_steps=K,
              speculative_policy="fixed") | kw
    llm = LLM(ckpt, **kw)
    eng = llm.engine
    if graphs:
        eng.spec.use_graphs(max_graph_reqs, eng.max_model_len, capture=False)
    if static_target:
        eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs,
                                 eng.cfg.decode_rows_per_req, eng.max_model_len, capture=False)
    if pattern is not None:
        from test_policy import PatternPolicy

        n = eng.cfg.max_running_reqs
        eng.decode_graphs = GraphRunner(
            eng.runner, n, 1, eng.max_model_len, capture=False,
            hidden_ring=hidden_ring_steps(eng.spec, eng.model, n) if ring else 0)
        PatternPolicy(K, pattern).install(eng)
    return llm


def record_drafts(llm: LLM) -> dict[tuple[int, ...], list[int]]:
    """Drafts of every verify step keyed by the sequence they continue (prompt + output)."""
    spec, seen = llm.engine.spec, {}
    propose = spec.propose

    def recording(batch):
        propose(batch)
        drafts = (batch.draft_tensor.tolist() if batch.draft_tensor is not None
                  else batch.draft_ids)
        for req, d, n in zip(batch.reqs, drafts, batch.num_drafts):
            seen[tuple(req.all_ids)] = d[:n]

    spec.propose = recording
    return seen


def turns(llm: LLM, max_tokens: int) -> list[list[int]]:
    """Three greedy requests of different lengths ending at different steps (the batch shrinks
    from 3 to 1), then a second turn of each that resumes from the prefix cache."""
    batch = [tokens(n, seed=n) for n in (5, 64, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens // d, ignore_eos=True)
              for d in (1, 3, 2)]
    first = [o.token_ids for o in llm.generate(batch, params)]
    follow = [p + o + tokens(3, seed=7) for p, o in zip(batch, first)]
    return first + [o.token_ids for o in llm.generate(follow, params)]


def test_graph_step_drafts_equal_the_eager_proposer_and_greedy_equals_plain(ckpt):
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4)
    eager, graph = make(ckpt, graphs=False), make(ckpt, graphs=True)
    want_drafts, got_drafts = record_drafts(eager), record_drafts(graph)
    want = turns(plain, 30)
    assert turns(eager, 30) == want
    assert turns(graph, 30) == want
    mtp_graphs = graph.engine.spec.proposer.graphs
    # batches of 3 ran eagerly (past the 2-request bucket), of 1 and 2 through the step
    assert mtp_graphs.steps > 5 and set(mtp_graphs.graphs) == {1, 2}
    common = want_drafts.keys() & got_drafts.keys()
    assert len(common) > 20
    for key in common:
        assert got_drafts[key] == want_drafts[key], f"drafts after {len(key)} tokens"
    assert_drained(graph.engine)


def test_drafts_on_the_device_feed_the_verify_step_with_decode_steps_between(ckpt):
    """Target steps fixed-shape too (the drafts reach the verify input on the device), and a
    policy that puts plain decode steps (k = 0) between verify steps: the rows a decode step
    leaves wait for the next graph step, or (past k+1 rows) are caught up eagerly."""
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4)
    eager = make(ckpt, graphs=False)
    llm = make(ckpt, graphs=True, static_target=True, max_graph_reqs=4)
    for engine in (eager.engine, llm.engine):
        pattern = itertools.cycle([K, K, 0, K, 0, 0, 0, 0, 0, K])
        engine.scheduler.choose_drafts = lambda reqs, p=pattern: next(p)
    want_drafts, got_drafts = record_drafts(eager), record_drafts(llm)
    want = turns(plain, 24)
    assert turns(eager, 24) == want
    assert turns(llm, 24) == want
    common = want_drafts.keys() & got_drafts.keys()
    assert len(common) > 10
    assert all(got_drafts[key] == want_drafts[key] for key in common)
    assert llm.engine.spec.proposer.graphs.steps > 5
    assert llm.engine.graphs.graph_steps > 5
    assert_drained(llm.engine)


def test_seeded_sampling_is_the_same_with_the_graph_step(ckpt):
    """A sampled request beside greedy ones: its drafts come back with the accepted counts
    (one copy) and the rejection sampler sees the same drafts and draws as with the eager
    proposer."""
    batch = [tokens(n, seed=n) for n in (9, 40, 70)]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=14,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)]
    want = [o.token_ids for o in make(ckpt, graphs=False).generate(batch, params)]
    llm = make(ckpt, graphs=True, static_target=True, max_graph_reqs=4)
    assert [o.token_ids for o in llm.generate(batch, params)] == want
    assert llm.engine.spec.proposer.graphs.steps > 0
    assert_drained(llm.engine)


def test_device_acceptance_equals_the_host_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, k = 5, int(torch.randint(1, 5, (1,), generator=gen))
        greedy = torch.randint(0, 3, (n, k + 1), generator=gen)
        drafts = torch.randint(0, 3, (n, k), generator=gen)
        num = torch.randint(0, k + 1, (n,), generator=gen)
        got = accept_greedy_rows(greedy.reshape(-1), drafts, num).tolist()
        for i in range(n):
            want = accept(greedy[i].tolist(), drafts[i, :num[i]].tolist())
            assert greedy[i, :got[i] + 1].tolist() == want
        full = accept_greedy_rows(greedy.reshape(-1), drafts).tolist()
        for i in range(n):
            assert greedy[i, :full[i] + 1].tolist() == accept(greedy[i].tolist(),
                                                                      drafts[i].tolist())


@pytest.mark.parametrize("cap", [None, 2])
def test_drafts_after_overlapped_decode_steps_equal_the_oracle_head(ckpt, cap, monkeypatch):
    """Plain decode steps overlapped (engine/overlap.py) between verify steps: their hidden
    states reach the proposer at launch and their catch-up waits for the next verify, whose
    first draft is still the MTP head's argmax over the whole sequence. cap 2: every second
    such step catches the landed rows up at once (proposer.AHEAD_CAP)."""
    from test_mtp_proposer import oracle_mtp_logits

    from deltaserve.spec.mtp import proposer

    if cap is not None:
        monkeypatch.setattr(proposer, "AHEAD_CAP", cap)
    catch_ups = []
    catch_up = proposer.MTPProposer._catch_up
    monkeypatch.setattr(proposer.MTPProposer, "_catch_up",
                        lambda self, reqs, keep=0: catch_ups.append(keep) or
                        catch_up(self, reqs, keep))

    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4)
    llm = make(ckpt, graphs=True, static_target=True, max_graph_reqs=4, pattern="vvdddddvdd")
    eng = llm.engine
    got = record_drafts(llm)
    assert turns(llm, 24) == turns(plain, 24)
    assert eng.overlap.overlapped_steps > 5 and eng.spec.proposer.graphs.steps > 5
    assert len(got) > 10
    for seq, drafts in got.items():
        assert drafts[0] == int(oracle_mtp_logits(ckpt, list(seq))[-1].argmax()), len(seq)
    # cap 2: the capped path ran too (without it: 4 catch-ups keeping K + 1 rows, in
    # _propose_graph, for rows past the graph's K + 1)
    assert catch_ups.count(K + 1) >= (12 if cap is not None else 1)
    assert_drained(eng)


@pytest.mark.parametrize("pattern", ["vvdddddvdd", "vddddddddddddddddddd"])
def test_the_hidden_ring_gives_the_head_the_rows_a_clone_gives(ckpt, pattern, monkeypatch):
    """Plain decode steps that hand out their hidden rows as views of the ring (cuda_graph.py)
    feed the MTP head, in its catch-ups and its graph steps, bitwise the rows that clones
    after each replay feed it: with AHEAD_CAP 2 the ring is 18 steps long and wraps many
    times, so a view read after its slot was overwritten would show."""
    from deltaserve.spec.mtp import proposer

    monkeypatch.setattr(proposer, "AHEAD_CAP", 2)

    def run(ring: bool):
        llm = make(ckpt, graphs=True, static_target=True, max_graph_reqs=4, pattern=pattern,
                   ring=ring)
        head, seen = llm.engine.spec.proposer.head, []
        forward = head.forward
        head.forward = lambda ids, hidden, ctx, **kw: (seen.append(hidden.clone()),
                                                       forward(ids, hidden, ctx, **kw))[1]
        return turns(llm, 40), seen, llm.engine

    want, want_rows, _ = run(False)
    got, got_rows, eng = run(True)
    steps = eng.decode_graphs.ring_steps
    assert steps == 2 + 2 * (K + 1) + 8 and eng.overlap.launched_steps > 2 * steps
    assert got == want and len(got_rows) == len(want_rows) > 20
    assert all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))
    assert_drained(eng)


def test_arrivals_a_stop_an_abort_and_sampling_with_overlapped_plain_steps(ckpt):
    """The mixed workload of test_overlap.py on an MTP engine whose policy puts runs of plain
    decode steps between verify steps: with overlap scheduling the greedy requests give the
    synchronous engine's tokens, the stop and the abort leave nothing behind."""
    from overlap_driver import abort, add, drive, first_new

    def engine(overlap: bool):
        return make(ckpt, graphs=True, static_target=True, max_graph_reqs=4,
                    pattern="vvdddddvdd", overlap_schedule=overlap).engine

    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (20, 24, 30, 16)]
    prompts = [tokens(n, seed=n) for n in (5, 40, 70, 17, 90)]
    (alone,) = drive(engine(False), {0: [add(1, prompts[1], greedy[1])]}).values()
    stop = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                          stop_token_ids=[alone.tokens[first_new(alone.tokens, 3)]])
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True)
    script = {0: [add(0, prompts[0], greedy[0]), add(1, prompts[1], stop),
                  add(2, prompts[2], sampled), add(3, prompts[3], greedy[2])],
              5: [add(4, prompts[4], greedy[3])],
              8: [abort(3)]}
    sync, over = engine(False), engine(True)
    want, got = drive(sync, script), drive(over, script)
    assert over.overlap.overlapped_steps > 3 and over.spec_steps > 0 and sync.overlap is None
    for rid in (0, 1, 4):
        assert (got[rid].tokens, got[rid].reason) == (want[rid].tokens, want[rid].reason), rid
    assert want[1].reason == "stop" and len(want[1].tokens) < 24
    assert len(got[2].tokens) == len(want[2].tokens) == 14  # sampled: its own draws
    a, b = sorted((got[3].tokens, want[3].tokens), key=len)  # aborted: one is a prefix
    assert b[:len(a)] == a and len(b) < 30
    assert_drained(over)
    assert_drained(sync)


def test_no_ring_for_the_eager_proposer_which_holds_rows_without_a_bound(ckpt):
    """Without MTP graphs, rows launched ahead wait for the next verify however long the
    plain run: the plain decode graphs clone instead (hidden_ring_steps is 0)."""
    eager = make(ckpt, graphs=False, pattern="vdd", ring=True).engine
    graph = make(ckpt, graphs=True, pattern="vdd", ring=True).engine
    assert eager.spec.proposer.hidden_steps_held == 0 and eager.decode_graphs.ring is None
    assert graph.spec.proposer.hidden_steps_held > 0 and graph.decode_graphs.ring is not None
