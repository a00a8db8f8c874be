"""N-gram proposer (prompt lookup decoding, Saxena 2023): copy what followed the latest
earlier occurrence of the sequence's trailing n-gram.

Cost per request per step: the tokens committed since the last step are appended to a
per-request buffer of their int32 bytes (no rebuild of the whole sequence), then each n-gram
size is one reverse memory search of the tail's bytes (`bytearray.rfind`, in C: the latest
occurrence comes first, so the search usually stops early; no match costs one scan). For
sequences up to `search_max` tokens this beats a vectorised numpy candidate filter (a dozen
numpy calls per request: 14 µs of the 43 µs per request of a batch-32 n-gram verify step's host
work, bench_step_host.py); past it, where a scan costs more than those calls, the numpy filter
runs instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltaserve.core import Req
from deltaserve.spec.proposer import Proposer


class _TokenBuffer:
    """A request's tokens as int32 bytes (token ids < 2^31), appended to as tokens are
    committed."""

    __slots__ = ("raw", "n")

    def __init__(self) -> None:
        self.raw = bytearray()
        self.n = 0

    def sync(self, req: Req) -> bytearray:
        """Append req's tokens [n, num_tokens) and return the whole sequence's bytes."""
        total = req.num_tokens
        if total < self.n:  # never expected (tokens are only appended): start over
            self.raw.clear()
            self.n = 0
        if total > self.n:
            self.raw += np.asarray(req.tokens(self.n, total), dtype=np.int32).tobytes()
            self.n = total
        return self.raw


class NgramProposer(Proposer):
    """Drafts up to k tokens per request; may return fewer, or none when nothing matches.

    Tries n-gram sizes from `max_n` down to `min_n`; the most recent match wins.
    """

    def __init__(self, num_steps: int, max_n: int = 4, min_n: int = 1,
                 search_max: int = 2048) -> None:
        self.num_steps, self.max_n, self.min_n = num_steps, max_n, min_n
        self.search_max = search_max  # longer sequences: `_lookup_vectorised`
        self._buffers: dict[int, _TokenBuffer] = {}  # rid -> its tokens so far

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        out = []
        for req in reqs:
            buf = self._buffers.get(req.rid)
            if buf is None:
                buf = self._buffers[req.rid] = _TokenBuffer()
            out.append(self._lookup(buf.sync(req)))
        return out

    def release(self, req: Req) -> None:
        self._buffers.pop(req.rid, None)

    def lookup(self, ids: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        matching tail n-gram (n from max_n down to min_n); [] when none occurs."""
        return self._lookup(np.ascontiguousarray(ids, dtype=np.int32).tobytes())

    def _lookup(self, raw: bytes | bytearray) -> list[int]:
        """`lookup` over the tokens' int32 bytes, by reverse memory search (`rfind`, in C).

        A longer tail n-gram occurs only where a shorter one ends, so n goes up from min_n: the
        latest occurrence of each n lies at or before the previous n's, and the first n with
        none ends the search (a sequence without a match costs one scan). A hit at a byte
        offset that is not a multiple of 4 straddles two tokens: the search goes on before it.
        """
        length = len(raw) // 4
        if length > self.search_max:
            return self._lookup_vectorised(np.frombuffer(raw, dtype=np.int32))
        best = -1  # the token after the longest tail n-gram's latest occurrence
        end = (length - 1) * 4  # occurrences lie in ids[:-1]: a next token exists
        for n in range(self.min_n, min(self.max_n, length - 1) + 1):
            tail = bytes(raw[(length - n) * 4:])
            while (at := raw.rfind(tail, 0, end)) >= 0 and at % 4:
                end = at + len(tail) - 1
            if at < 0:
                break
            best, end = at // 4 + n, at + len(tail)
        if best < 0:
            return []
        count = min(self.num_steps, length - best)
        return np.frombuffer(raw, dtype=np.int32, count=count, offset=best * 4).tolist()

    def _lookup_vectorised(self, a: np.ndarray) -> list[int]:
        """`lookup` by numpy (ids int32 [L]): the earlier positions holding the last token in
        one vectorised compare, then only those candidates checked against the rest of each
        tail n-gram. A dozen numpy calls whatever L, O(L) in C: slower than `rfind` for short
        sequences, 4x faster for a 32 k-token one without a match (bench_host.py)."""
        length = a.size
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
