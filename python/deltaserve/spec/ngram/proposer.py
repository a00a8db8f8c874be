"""N-gram proposer (prompt lookup decoding, Saxena 2023): copy what followed the latest
earlier occurrence of the sequence's trailing n-gram."""

from __future__ import annotations

from deltaserve.core import Req
from deltaserve.spec.proposer import Proposer


class NgramProposer(Proposer):
    """Drafts up to k tokens per request; may return fewer, or none when nothing matches.

    Tries n-gram sizes from `max_n` down to `min_n`; the most recent match wins.
    """

    def __init__(self, num_steps: int, max_n: int = 4, min_n: int = 1) -> None:
        self.num_steps, self.max_n, self.min_n = num_steps, max_n, min_n

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        return [self.lookup(r.all_ids) for r in reqs]

    def lookup(self, ids: list[int]) -> list[int]:
        k = self.num_steps
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return follow
        return []
