"""Speculation with stops and the prefix cache: nothing after a stop is returned or cached, a
follow-up turn built from what was returned gets its full prefix hit, a verify step crossing a
grid boundary takes no snapshot there, lookahead keys, chunk snapshots and a host bank keep
multi-turn outputs exact."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.proposer import Proposer
from drained import assert_drained
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens


class OracleProposer(Proposer):
    """Drafts the known greedy continuation of each prompt (every draft right)."""

    def __init__(self, k: int, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.num_steps, self.refs = k, refs

    def propose(self, reqs):
        return [self.refs.get(tuple(r.prompt_ids), [])[len(r.output_ids):][:self.num_steps]
                for r in reqs]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("fin") / "m", "qwen3_5_text",
                                    seed=6))


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory):
    # a stale or misplaced GDN state changes the tokens
    return slow_decay_checkpoint(tmp_path_factory.mktemp("slow") / "m", seed=9)


def llm(ckpt: str, **kw) -> LLM:
    """Every decode step verifies (these tests are about what a verify commits)."""
    if "speculative_algorithm" in kw:
        kw.setdefault("speculative_policy", "fixed")
    return LLM(ckpt, device="cpu", dtype="float32", num_pages=1024, page_size=16, **kw)


def test_a_stop_token_inside_accepted_drafts_ends_the_output_and_the_cached_path(ckpt):
    prompt = tokens(124, seed=1)  # 124 + 5 returned - 1 = 128 tokens processed: on the grid
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = llm(ckpt).generate([prompt], greedy)[0].token_ids
    stop_at = next(i for i in range(4, 20) if plain[i] not in plain[:i])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            stop_token_ids=[plain[stop_at]])
    spec = llm(ckpt, speculative_algorithm="ngram", speculative_num_steps=4)
    spec.engine.spec.proposer = OracleProposer(4, {tuple(prompt): plain})
    (out,) = spec.generate([prompt], params)
    assert out.token_ids == plain[:stop_at + 1]
    assert out.finish_reason == "stop"
    # the follow-up turn is built from what was returned; the cache must hold exactly that
    follow = prompt + out.token_ids + tokens(9, seed=2)
    (turn2,) = spec.generate([follow], greedy)
    processed = len(prompt) + len(out.token_ids) - 1
    assert turn2.cached_tokens == (processed // 64) * 64
    cold = llm(ckpt, enable_prefix_cache=False).generate([follow], greedy)[0]
    assert turn2.token_ids == cold.token_ids


def test_a_verify_step_crossing_a_grid_boundary_takes_no_snapshot_and_the_end_resumes_exactly(
        slow_ckpt):
    prompt = tokens(100, seed=10)
    # 100 + 93 - 1 = 192 tokens processed at the end: on the grid; verify steps of 5 accepted
    # rows run 100 -> 105 -> ... -> 125 -> 130, so 128 is crossed inside a step
    greedy = SamplingParams(temperature=0.0, max_tokens=93, ignore_eos=True)
    plain = llm(slow_ckpt, enable_prefix_cache=False).generate([prompt], greedy)[0].token_ids
    spec = llm(slow_ckpt, chunk_size=64, speculative_algorithm="ngram",
               speculative_num_steps=4)
    spec.engine.spec.proposer = OracleProposer(4, {tuple(prompt): plain})
    (out,) = spec.generate([prompt], greedy)
    assert out.token_ids == plain
    # every verify step but the last (cut by max_tokens) kept all 5 rows
    assert spec.engine.spec_steps == -(-(len(plain) - 1) // 5)
    cold = llm(slow_ckpt, enable_prefix_cache=False)
    follow = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # cut between 128 and 192: only the prompt's boundary at 64 is below it
    cut = prompt + out.token_ids[:50] + tokens(7, seed=11)
    # the whole answer: the live state at release (192, exact after the replay) is cached
    turn = prompt + out.token_ids + tokens(7, seed=12)
    for ids, hit in ((cut, 64), (turn, 192)):
        (got,) = spec.generate([ids], follow)
        assert got.cached_tokens == hit
        assert got.token_ids == cold.generate([ids], follow)[0].token_ids
    assert_drained(spec.engine)


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("host_slots", [0, 3])
def test_turns_a_b_a_with_speculation_match_the_cache_off(slow_ckpt, lookahead, host_slots):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a1, b1 = tokens(140, seed=3), tokens(150, seed=4)
    cold = llm(slow_ckpt, enable_prefix_cache=False)
    # with a bank: 3 device slots (a live one, a track, one more), so B's prefill pushes A's
    # snapshots (the chunk snapshot at 64, the last boundary at 128) out to the bank
    small = dict(max_running_reqs=1, num_snapshot_slots=1) if host_slots else {}
    spec = llm(slow_ckpt, speculative_algorithm="ngram", speculative_num_steps=3, chunk_size=64,
               radix_lookahead=lookahead, host_snapshot_slots=host_slots, **small)
    ra = spec.generate([a1], greedy)[0]
    rb = spec.generate([b1], greedy)[0]
    a2 = a1 + ra.token_ids + tokens(20, seed=5)  # A's next turn
    a3 = a1[:100] + tokens(10, seed=6)  # A replayed from inside its second chunk
    cache = spec.engine.prefix_cache
    for prompt, hit in ((a2, 128), (a3, 64)):
        match = cache.match(prompt)
        assert match.cached_len == hit
        assert (match.host_slot is not None) == bool(host_slots)  # restored from the bank
    ra2, ra3 = (spec.generate([p], greedy)[0] for p in (a2, a3))
    assert (ra2.cached_tokens, ra3.cached_tokens) == (128, 64)
    for prompt, got in ((a1, ra), (b1, rb), (a2, ra2), (a3, ra3)):
        assert got.token_ids == cold.generate([prompt], greedy)[0].token_ids
    assert_drained(spec.engine)


def test_a_stop_string_inside_accepted_drafts_ends_the_text_and_the_tokens(tmp_path):
    import json
    import shutil
    from importlib import resources

    files = resources.files("deltaserve.default_model") / "files"
    vocab = len(json.loads((files / "tokenizer.json").read_text())["model"]["vocab"])
    path = make_tiny_checkpoint(tmp_path / "tok", "qwen3_5_text", seed=7, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(str(files / name), path / name)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = tokens(40, seed=8)
    plain = LLM(str(path), device="cpu", dtype="float32", num_pages=256, page_size=16)
    (p,) = plain.generate([prompt], greedy)
    tok = plain.tokenizer
    # a stop string that first appears in the text of output token j (j >= 3)
    j, stop = next((i, tok.decode([t])) for i, t in enumerate(p.token_ids)
                   if i >= 3 and len(tok.decode([t]).strip()) >= 2
                   and tok.decode([t]) not in tok.decode(p.token_ids[:i]))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    spec = LLM(str(path), device="cpu", dtype="float32", num_pages=256, page_size=16,
               speculative_algorithm="ngram", speculative_num_steps=4, speculative_policy="fixed")
    spec.engine.spec.proposer = OracleProposer(4, {tuple(prompt): p.token_ids})
    (out,) = spec.generate([prompt], params)
    assert out.finish_reason == "stop"
    assert out.token_ids == p.token_ids[:j + 1]  # nothing committed after the stop
    assert stop not in out.text and p.text.startswith(out.text)
