"""Overlap scheduling (engine/overlap.py) gives the synchronous step's outputs token for token:
greedy and seeded sampling, finishes by stop token, EOS and length at different steps,
requests arriving and aborted mid-decode, the prefix cache (a finish on the snapshot grid
included), and no page or slot leaks. Run on CPU through the fixed-shape step (overlap_driver)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.core import Req
from deltaserve.engine.overlap import finishes_by_length, overlappable
from drained import assert_drained
from overlap_driver import (
    abort,
    add,
    drive,
    first_new,
    make_engine,
    snapshots,
    stop_at,
    stop_on_grid,
)
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # slow decay: a stale GDN state (one token too many) changes the tokens that follow
    return slow_decay_checkpoint(tmp_path_factory.mktemp("overlap") / "m", seed=3)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def sampled(n: int, seed: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.9)
    return SamplingParams(max_tokens=n, seed=seed, ignore_eos=True, **kw)


def test_finishes_by_length_counts_the_tokens_still_on_the_device():
    req = Req(rid=0, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4), max_len=7)
    req.output_ids = [5, 6]
    req.ahead = 1
    assert not finishes_by_length(req)  # 3 of 4 once the launched token lands
    req.ahead = 2
    assert finishes_by_length(req)
    req = Req(rid=1, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=40), max_len=6)
    req.output_ids, req.ahead = [5, 6], 1
    assert finishes_by_length(req)  # the context (max_len) ends it


def test_rows_that_need_the_previous_token_on_the_host_do_not_overlap():
    def req(**kw) -> Req:
        return Req(rid=0, prompt_ids=[1], params=SamplingParams(**kw), max_len=9)
    assert overlappable(req(temperature=0.0)) and overlappable(req(top_p=0.5, seed=3))
    assert not overlappable(req(logprobs=2))
    assert not overlappable(req(repetition_penalty=1.2))
    assert not overlappable(req(presence_penalty=0.5))
    assert not overlappable(req(frequency_penalty=0.5))


def test_a_mixed_workload_gives_the_synchronous_tokens(ckpt):
    prompts = [tokens(n, seed=n) for n in (5, 40, 70, 17, 90, 33, 26)]
    sync_engine = partial(make_engine, ckpt, False)
    params = [
        greedy(9),
        stop_at(sync_engine, prompts[1], greedy(20), 3),  # a stop token ends it at step 3
        sampled(14, seed=7, top_p=0.9),
        stop_at(sync_engine, prompts[3], sampled(20, seed=11, top_k=5, min_p=0.05), 6),
        greedy(30),  # aborted mid-decode
        sampled(12, seed=5, temperature=1.3),  # arrives mid-decode
        SamplingParams(temperature=0.0, max_tokens=20),  # EOS (below) at step 4 or later
    ]
    (alone,) = drive(sync_engine(), {0: [add(6, prompts[6], greedy(20))]}).values()
    eos = alone.tokens[first_new(alone.tokens, 4)]
    script = {0: [add(i, prompts[i], params[i]) for i in range(4)],
              1: [add(4, prompts[4], params[4]), add(6, prompts[6], params[6])],
              5: [add(5, prompts[5], params[5])],
              8: [abort(4)]}
    sync, over = make_engine(ckpt, overlap=False), make_engine(ckpt, overlap=True)
    for eng in (sync, over):
        eng.eos_ids.add(eos)  # the scheduler's set: only request 6 does not ignore EOS
    want, got = drive(sync, script), drive(over, script)
    # the overlap path ran for a good share of the decode steps (10 of them with in-forward
    # prefill snapshots, which save a forward per prompt)
    assert over.overlap is not None and over.overlap.overlapped_steps >= 8
    assert sync.overlap is None
    for rid in (0, 1, 2, 3, 5, 6):
        assert (got[rid].tokens, got[rid].reason) == (want[rid].tokens, want[rid].reason), rid
    assert [want[r].reason for r in (1, 3, 6)] == ["stop"] * 3
    assert all(len(want[r].tokens) < 20 for r in (1, 3, 6)) and want[6].tokens[-1] == eos
    # the abort came at the same call, but an overlapped engine has emitted one step less
    a, b = got[4].tokens, want[4].tokens
    assert 0 < len(a) <= len(b) < 30 and b[:len(a)] == a
    assert over.overlap.discarded_rows >= 3  # the stop rows one step past their finish
    assert_drained(over)
    assert_drained(sync)


def test_length_finishes_are_never_launched_past_their_end(ckpt):
    eng = make_engine(ckpt, overlap=True)
    script = {0: [add(i, tokens(20 + i, seed=i), greedy(3 + 4 * i)) for i in range(4)]}
    res = drive(eng, script)
    assert [len(r.tokens) for r in res.values()] == [3, 7, 11, 15]
    # decode rows launched: one per token after the first (from prefill), none discarded
    assert eng.overlap.launched_rows == sum(2 + 4 * i for i in range(4))
    assert eng.overlap.discarded_rows == 0
    assert_drained(eng)


def test_penalties_and_logprobs_rows_run_synchronously_with_the_same_outputs(ckpt):
    prompts = [tokens(n, seed=n + 100) for n in (12, 30, 50)]
    params = [greedy(10, logprobs=2), sampled(10, seed=3, repetition_penalty=1.3),
              sampled(10, seed=4, presence_penalty=0.7, frequency_penalty=0.4)]
    script = {0: [add(i, p, q) for i, (p, q) in enumerate(zip(prompts, params))]}
    sync, over = make_engine(ckpt, overlap=False), make_engine(ckpt, overlap=True)
    want, got = drive(sync, script), drive(over, script)
    assert over.overlap.launched_steps == 0  # every step has such a row
    for rid in want:
        assert got[rid].tokens == want[rid].tokens
        assert got[rid].logprobs == want[rid].logprobs
    assert len(got[0].logprobs) == 10
    assert_drained(over)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_finish_on_the_grid_caches_no_stale_snapshot(ckpt, finish):
    # 181 prompt tokens + 12 outputs: 192 = 3 * 64 tokens processed at the finish. A stop
    # token found one step late leaves the live state one token past 192 (not cached); a
    # length finish is known early, never overlapped past, and its end snapshot is kept.
    prompt = tokens(181, seed=21)
    params = sampled(12, seed=9) if finish == "length" \
        else stop_on_grid(partial(make_engine, ckpt, False), prompt, 12, range(9, 40))
    sync, over = make_engine(ckpt, overlap=False), make_engine(ckpt, overlap=True)
    want = drive(sync, {0: [add(0, prompt, params)]})[0]
    got = drive(over, {0: [add(0, prompt, params)]})[0]
    assert got.tokens == want.tokens and (got.reason, len(got.tokens)) == (finish, 12)
    # the invariant: a snapshot at depth L is the state after exactly tokens[0:L]; the sync
    # engine's snapshots are that by construction, and decode steps are bitwise equal
    ref, mine = snapshots(sync), snapshots(over)
    assert 192 in ref
    assert (192 in mine) == (finish == "length")
    for depth, (rec, conv) in mine.items():
        assert torch.equal(rec, ref[depth][0]) and torch.equal(conv, ref[depth][1]), depth
    # a follow-up turn resumes from what each cached: the same tokens as without a cache
    turn2 = prompt + got.tokens + tokens(9, seed=22)
    cold = make_engine(ckpt, overlap=False, enable_prefix_cache=False)
    follow = drive(over, {0: [add(1, turn2, greedy(8))]})[1]
    assert follow.tokens == drive(cold, {0: [add(1, turn2, greedy(8))]})[1].tokens
    assert_drained(over)


def first_seen_at(text: str, at: int, size: int = 4) -> str:
    """A `size`-character piece of `text` whose first occurrence starts at or after `at`."""
    return next(text[i:i + size] for i in range(at, len(text) - size)
                if text.find(text[i:i + size]) == i)


def test_stop_strings_on_the_default_model_give_the_synchronous_text():
    prompts = ['def is_prime(n):\n    """Return True when n is a prime number."""\n',
               "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):\n"]
    params = [SamplingParams(temperature=0.0, max_tokens=32),
              SamplingParams(temperature=0.8, seed=3, max_tokens=32),
              SamplingParams(temperature=0.0, max_tokens=32)]  # length (or EOS)
    sync, over = make_engine(None, overlap=False), make_engine(None, overlap=True)
    ids = [sync.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    # stop strings from each request's own free text (a seeded draw depends only on the seed
    # and the position), a third and two thirds in, so requests 0 and 1 stop at different steps
    free = drive(make_engine(None, overlap=False),
                 {0: [add(i, ids[i], params[i]) for i in range(2)]})
    for i, share in ((0, 1 / 3), (1, 2 / 3)):
        text = free[i].text
        params[i] = dataclasses.replace(
            params[i], stop=[first_seen_at(text, int(share * len(text))), "prime prime"])
    script = {0: [add(i, ids[i], params[i]) for i in range(3)]}
    want, got = drive(sync, script), drive(over, script)
    for rid in want:
        assert (got[rid].tokens, got[rid].text, got[rid].reason) \
            == (want[rid].tokens, want[rid].text, want[rid].reason), rid
    # both stop strings end their request early, at different steps
    assert [(w.reason, len(w.tokens) < 32) for w in want.values()][:2] == [("stop", True)] * 2
    assert len(want[0].tokens) != len(want[1].tokens)
    assert over.overlap.overlapped_steps > 0 and over.overlap.discarded_rows > 0
    assert_drained(over)
