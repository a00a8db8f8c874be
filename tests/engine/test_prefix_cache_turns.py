"""Multi-turn prefix reuse: #cached-token is the deepest valid snapshot, outputs equal no-cache."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from drained import assert_drained
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return slow_decay_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", seed=2)


def make(ckpt: str, page_size: int, cache: bool = True, chunk_size: int = 64) -> LLM:
    return LLM(ckpt, device="cpu", dtype="float32", num_pages=2048 // page_size + 64,
               page_size=page_size, chunk_size=chunk_size, enable_prefix_cache=cache)


def check_clean(llm: LLM) -> None:
    """Every page and slot is free once requests are done and the cache is flushed."""
    assert_drained(llm.engine)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_turn_two_hits_the_deepest_snapshot_and_matches_no_cache(ckpt, page_size):
    turn1 = tokens(150, seed=1)
    llm, cold = make(ckpt, page_size), make(ckpt, page_size, cache=False)
    (a1,) = llm.generate([turn1], GREEDY)
    turn2 = turn1 + a1.token_ids + tokens(30, seed=2)
    (a2,) = llm.generate([turn2], GREEDY)
    # snapshots: the prompt's last grid boundary (128) and the finished request's end
    # (150 + 12 - 1 = 161 tokens processed, not on the grid) -> 128
    assert a1.cached_tokens == 0
    assert a2.cached_tokens == 128
    (c2,) = cold.generate([turn2], GREEDY)
    assert a2.token_ids == c2.token_ids
    check_clean(llm)


def test_a_request_ending_on_the_grid_leaves_a_snapshot_at_its_end(ckpt):
    turn1 = tokens(181, seed=3)  # 181 + 12 - 1 = 192 = 3 * 64 tokens processed at finish
    llm, cold = make(ckpt, 16), make(ckpt, 16, cache=False)
    (a1,) = llm.generate([turn1], GREEDY)
    turn2 = turn1 + a1.token_ids + tokens(5, seed=4)
    (a2,) = llm.generate([turn2], GREEDY)
    assert a2.cached_tokens == 192
    assert a2.token_ids == cold.generate([turn2], GREEDY)[0].token_ids
    check_clean(llm)


def test_two_requests_sharing_a_prefix_then_forking_match_no_cache(ckpt):
    shared = tokens(140, seed=5)
    p1, p2 = shared + tokens(20, seed=6), shared + tokens(25, seed=7)
    llm, cold = make(ckpt, 16), make(ckpt, 16, cache=False)
    (o1,) = llm.generate([p1], GREEDY)
    (o2,) = llm.generate([p2], GREEDY)
    (o1b,) = llm.generate([p1], GREEDY)
    assert o2.cached_tokens == 128 and o1b.cached_tokens == 128
    c1, c2 = cold.generate([p1, p2], GREEDY)
    assert o1.token_ids == c1.token_ids == o1b.token_ids
    assert o2.token_ids == c2.token_ids
    check_clean(llm)


@pytest.mark.parametrize("page_size", [1, 64])
def test_a_prompt_of_exactly_64n_tokens_and_a_one_token_tail(ckpt, page_size):
    base = tokens(128, seed=8)
    llm, cold = make(ckpt, page_size, chunk_size=48), make(ckpt, page_size, cache=False)
    (a,) = llm.generate([base], GREEDY)
    # the snapshot at 128 is the whole prompt (its last token is always recomputed), so the
    # boundary before it is kept too: an identical resend resumes at 64
    (again,) = llm.generate([base], GREEDY)
    tail = base + tokens(1, seed=9)
    (t,) = llm.generate([tail], GREEDY)
    assert a.cached_tokens == 0 and again.cached_tokens == 64
    assert t.cached_tokens == 128  # one-token tail recomputed from the snapshot
    c_base, c_tail = cold.generate([base, tail], GREEDY)
    assert a.token_ids == again.token_ids == c_base.token_ids
    assert t.token_ids == c_tail.token_ids
    check_clean(llm)
