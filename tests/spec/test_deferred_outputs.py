"""A verify step's outputs are emitted by the next step's call (LLMEngine.flush_outputs), while
that step's forward runs: they must still come out once each, in order, before anything newer
of the same request, and an abort in between must lose or leak nothing."""

from __future__ import annotations

import pytest
from test_verify_contract import StubProposer, prompts

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("deferred") / "m", "qwen3_5_text",
                                    seed=7))


def started(ckpt: str | None, seed: int):
    """An n-gram engine (fixed policy: every decode step a verify) whose stub proposer drafts
    the plain run's tokens, some corrupted (test_verify_contract.StubProposer), with the
    prompts of `seed` added. Returns (llm, rids, each one's plain greedy tokens)."""
    batch = prompts(seed=seed)
    plain = [o.token_ids for o in LLM(ckpt, device="cpu", dtype="float32", num_pages=512,
                                      page_size=16).generate(batch, GREEDY)]
    llm = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
              speculative_algorithm="ngram", speculative_num_steps=3,
              speculative_policy="fixed")
    llm.engine.spec.proposer = StubProposer(3, {tuple(p): o for p, o in zip(batch, plain)}, 512)
    return llm, [llm.engine.add_request(p, GREEDY) for p in batch], plain


def test_verify_outputs_come_with_the_next_call_in_order_and_once():
    """On the embedded model (it has a tokenizer): the text handed out is the tokens' too."""
    llm, rids, plain = started(None, seed=8)
    eng = llm.engine
    got = {rid: [] for rid in rids}
    text = {rid: "" for rid in rids}
    finished = []
    deferred_calls = 0
    while eng.has_unfinished():
        deferred_calls += eng._deferred is not None
        for out in eng.step():
            assert out.rid not in finished, "an output after the request's last"
            got[out.rid] += out.new_token_ids
            text[out.rid] += out.new_text
            if out.finished:
                finished.append(out.rid)
    assert deferred_calls > 0 and eng.spec_steps > 0
    assert sorted(finished) == sorted(rids)
    for rid, want in zip(rids, plain):
        assert got[rid] == want
        assert text[rid] == llm.tokenizer.decode(want, skip_special_tokens=True)
    assert_drained(eng)


def test_an_abort_while_outputs_are_deferred_loses_and_leaks_nothing(ckpt):
    llm, rids, plain = started(ckpt, seed=9)
    eng = llm.engine
    got = {rid: [] for rid in rids}
    while eng._deferred is None:
        for out in eng.step():
            got[out.rid] += out.new_token_ids
    victim = rids[0]
    assert eng.abort(victim) in (True, False)
    last = {}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.rid] += out.new_token_ids
            last[out.rid] = out
    for rid, want in zip(rids[1:], plain[1:]):
        assert got[rid] == want and last[rid].finished
    assert got[victim] == plain[0][:len(got[victim])]  # a prefix of its tokens, then nothing
    assert_drained(eng)
