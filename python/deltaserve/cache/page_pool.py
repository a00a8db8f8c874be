"""Allocator of KV pages: ids only (the KV tensors live with the attention backend).

A page holds `page_size` consecutive KV positions of every full-attention layer. Page 0 is a
padding sink: kernels may write it, so it is never handed out.
"""

from __future__ import annotations

from collections.abc import Iterable

from deltaserve.cache.free_list import FreeList


class PagePool:
    """Hands out page ids 1..num_pages-1, reused first-in first-out (free_list.py)."""

    __slots__ = ("num_pages", "page_size", "_ids")

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 1, "num_pages counts the padding page 0, so it is at least 1"
        assert page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        self._ids = FreeList(num_pages, first=1, noun="page")

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now."""
        return self._ids.num_free

    @property
    def num_allocated(self) -> int:
        return self._ids.num_allocated

    def is_allocated(self, page: int) -> bool:
        return self._ids.is_allocated(page)

    def can_allocate(self, n: int) -> bool:
        """Pure: whether `allocate(n)` would succeed."""
        return self._ids.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages; they are the caller's until it passes them to `free` (or hands
        them to the prefix cache, which frees them on eviction). Asserts `can_allocate(n)`."""
        return self._ids.allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Asserts each is allocated (no double free, no page 0) and
        listed once; on a failed assertion nothing has been freed."""
        self._ids.free(pages)

    def check_integrity(self) -> None:
        """Every page 1..num_pages-1 is exactly one of free / allocated; page 0 is neither."""
        self._ids.check_integrity()
