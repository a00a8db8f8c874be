"""The n-gram (prompt lookup) proposer."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.core import Req, SamplingParams
from deltaserve.spec.ngram.proposer import NgramProposer


def test_the_latest_match_of_the_longest_trailing_ngram_is_copied():
    p = NgramProposer(3)
    assert p.lookup([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert p.lookup([7, 1, 2, 9, 5, 1, 2, 8, 4, 1, 2]) == [8, 4, 1]  # most recent wins
    assert p.lookup([5, 6, 7, 8, 6, 7]) == [8, 6, 7]


def test_fewer_or_no_drafts_when_little_or_nothing_matches():
    p = NgramProposer(4)
    assert p.lookup([1, 2, 3, 1]) == [2, 3, 1]
    assert p.lookup([1, 2, 3, 4]) == []
    assert p.lookup([9]) == []


def reference_lookup(ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The definition, by brute force: for n from max_n down, the latest start whose n tokens
    equal the tail (the tail itself excluded), and up to k tokens after it."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(0, 4), min_size=0, max_size=60), k=st.integers(1, 5),
       max_n=st.integers(1, 5), search_max=st.sampled_from([0, 30, 2048]))
def test_lookup_equals_the_brute_force_definition(ids, k, max_n, search_max):
    """Both searches (byte search up to search_max tokens, vectorised past it)."""
    p = NgramProposer(k, max_n=max_n, search_max=search_max)
    assert p.lookup(ids) == reference_lookup(ids, k, max_n)


def test_propose_follows_a_growing_request_and_forgets_it_on_release():
    rng = random.Random(0)
    prompt = [rng.randrange(6) for _ in range(300)]
    req = Req(rid=7, prompt_ids=prompt, params=SamplingParams(), max_len=2000)
    p = NgramProposer(3, search_max=800)  # the request outgrows the byte search
    for _ in range(400):
        assert p.propose([req]) == [reference_lookup(req.all_ids, 3)]
        for _ in range(rng.randrange(1, 5)):  # a verify step commits 1..k+1 tokens
            req.append_output(rng.randrange(6))
    p.release(req)
    assert p._buffers == {}


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.sampled_from([0, 1, 255, 256, 257, 65536, 2 ** 24, 2 ** 30 + 1, 248319]),
                    min_size=0, max_size=40), k=st.integers(1, 5), max_n=st.integers(1, 5),
       search_max=st.sampled_from([0, 2048]))
def test_lookup_equals_the_definition_for_ids_whose_bytes_overlap(ids, k, max_n, search_max):
    """Ids whose int32 bytes repeat inside and across tokens (zero bytes, 0x01, 0xff): the
    byte search finds misaligned hits that must be skipped, never returned."""
    p = NgramProposer(k, max_n=max_n, search_max=search_max)
    assert p.lookup(ids) == reference_lookup(ids, k, max_n)
