"""The n-gram (prompt lookup) proposer."""

from __future__ import annotations

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
