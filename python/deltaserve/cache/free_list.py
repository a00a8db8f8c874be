"""The id allocator shared by the page pool, the GDN state pool and the host snapshot bank.

Ids first..n-1 (first = 1 where id 0 is a padding sink that kernels may write), each either
free or allocated. Free ids are reused first-in first-out, so an id freed too early is not
handed out again at once and a use-after-free shows up in tests as a mismatch instead of
staying silent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class FreeList:
    """Free / allocated bookkeeping of ids `first..n-1`; `noun` names them in messages."""

    __slots__ = ("first", "n", "noun", "_free", "_allocated")

    def __init__(self, n: int, first: int, noun: str) -> None:
        assert 0 <= first <= max(n, first), (n, first)
        self.first, self.n, self.noun = first, n, noun
        self._free: deque[int] = deque(range(first, n))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def is_allocated(self, i: int) -> bool:
        return i in self._allocated

    def can_allocate(self, n: int) -> bool:
        """Pure: whether `allocate(n)` would succeed."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free ids (oldest freed first). Asserts `can_allocate(n)`."""
        assert self.can_allocate(n), f"allocate({n}) with {len(self._free)} {self.noun}s free"
        ids = [self._free.popleft() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids. Asserts each is allocated (no double free, never a padding id) and
        listed once; on a failed assertion nothing has been freed."""
        ids = list(ids)
        assert len(set(ids)) == len(ids), f"{self.noun} listed twice in free({ids})"
        for i in ids:
            assert i in self._allocated, f"free of {self.noun} {i}, which is not allocated"
        self._allocated.difference_update(ids)
        self._free.extend(ids)

    def check_integrity(self) -> None:
        """Every id first..n-1 is exactly one of free / allocated, and no other id is."""
        free = set(self._free)
        assert len(free) == len(self._free), f"a {self.noun} is on the free list twice"
        both = free & self._allocated
        assert not both, f"{self.noun}s both free and allocated: {both}"
        everything = free | self._allocated
        expected = set(range(self.first, self.n))
        assert everything == expected, f"{self.noun}s lost or foreign: {expected ^ everything}"
