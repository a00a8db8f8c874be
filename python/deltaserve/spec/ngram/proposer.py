"""N-gram proposer (prompt lookup decoding, Saxena 2023): copy what followed the latest
earlier occurrence of the sequence's trailing n-gram.

Cost per request per step: the tokens committed since the last step are appended to a
per-request numpy buffer (no rebuild of the whole sequence), then one vectorised pass finds
the earlier positions holding the last token, and only those candidates are checked against
the rest of the tail: O(L) in C plus O(matches x n), instead of O(L x n) Python slicing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltaserve.core import Req
from deltaserve.spec.proposer import Proposer


class _TokenBuffer:
    """A request's tokens as an int64 numpy array that grows by doubling."""

    __slots__ = ("data", "n")

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, req: Req) -> np.ndarray:
        """Append req's tokens [n, num_tokens) and return the whole sequence (a view)."""
        total = req.num_tokens
        if total < self.n:  # never expected (tokens are only appended): start over
            self.n = 0
        if total > self.data.size:
            grown = np.empty(max(total, 2 * self.data.size), dtype=np.int64)
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        if total > self.n:
            self.data[self.n:total] = req.tokens(self.n, total)
            self.n = total
        return self.data[:total]


class NgramProposer(Proposer):
    """Drafts up to k tokens per request; may return fewer, or none when nothing matches.

    Tries n-gram sizes from `max_n` down to `min_n`; the most recent match wins.
    """

    def __init__(self, num_steps: int, max_n: int = 4, min_n: int = 1) -> None:
        self.num_steps, self.max_n, self.min_n = num_steps, max_n, min_n
        self._buffers: dict[int, _TokenBuffer] = {}  # rid -> its tokens so far

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        out = []
        for req in reqs:
            buf = self._buffers.get(req.rid)
            if buf is None:
                buf = self._buffers[req.rid] = _TokenBuffer()
            out.append(self.lookup(buf.sync(req)))
        return out

    def release(self, req: Req) -> None:
        self._buffers.pop(req.rid, None)

    def lookup(self, ids: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        matching tail n-gram (n from max_n down to min_n); [] when none occurs."""
        a = np.asarray(ids, dtype=np.int64)
        length = a.size
        if length < 2:
            return []
        # ends j of earlier n-grams: j <= length - 2, so a following token exists
        ends = np.flatnonzero(a[:length - 1] == a[length - 1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            cand = ends[ends >= n - 1]
            for back in range(1, n):  # the rest of the tail, from its second-to-last token
                if cand.size == 0:
                    break
                cand = cand[a[cand - back] == a[length - 1 - back]]
            if cand.size:
                end = int(cand[-1])
                return a[end + 1:end + 1 + self.num_steps].tolist()
        return []
