"""Allocator of KV pages: ids only (the KV tensors live with the attention backend).

A page holds `page_size` consecutive KV positions of every full-attention layer. Page 0 is a
padding sink: kernels may write it, so it is never handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PagePool:
    """Hands out page ids 1..num_pages-1.

    Free pages are reused first-in first-out, so a page freed too early is not handed out again
    at once and a use-after-free shows up in tests as a mismatch rather than staying silent.
    """

    __slots__ = ("num_pages", "page_size", "_free", "_allocated")

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 1, "num_pages counts the padding page 0, so it is at least 1"
        assert page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def is_allocated(self, page: int) -> bool:
        return page in self._allocated

    def can_allocate(self, n: int) -> bool:
        """Pure: whether `allocate(n)` would succeed."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages; they are the caller's until it passes them to `free` (or hands
        them to the prefix cache, which frees them on eviction). Asserts `can_allocate(n)`."""
        assert self.can_allocate(n), f"allocate({n}) with {len(self._free)} pages free"
        pages = [self._free.popleft() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Asserts each is allocated (no double free, no page 0) and
        listed once; on a failed assertion nothing has been freed."""
        pages = list(pages)
        assert len(set(pages)) == len(pages), f"page listed twice in free({pages})"
        for page in pages:
            assert page in self._allocated, f"free of page {page}, which is not allocated"
        self._allocated.difference_update(pages)
        self._free.extend(pages)

    def check_integrity(self) -> None:
        """Every page 1..num_pages-1 is exactly one of free / allocated; page 0 is neither."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        both = free & self._allocated
        assert not both, f"pages both free and allocated: {both}"
        everything = free | self._allocated
        assert everything == set(range(1, self.num_pages)), (
            f"pages lost or foreign: {set(range(1, self.num_pages)) ^ everything}")
