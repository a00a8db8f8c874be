"""Allocator of KV pages: ids only (the KV tensors live with the attention backend).

A page holds `page_size` consecutive KV positions of every full-attention layer. Page 0 is a
padding sink: kernels may write it, so it is never handed out.
"""

from __future__ import annotations

from deltaserve.cache.free_list import FreeList


class PagePool(FreeList):
    """Hands out page ids 1..num_pages-1 (FreeList: FIFO reuse, so a page freed too early is
    not handed out again at once; `allocate(n)`, `free(pages)` asserting each is allocated
    and listed once, `check_integrity()`). Pages handed to the prefix cache are freed by its
    eviction."""

    __slots__ = ("num_pages", "page_size")

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 1, "num_pages counts the padding page 0, so it is at least 1"
        assert page_size >= 1
        super().__init__(num_pages, first=1, noun="page")
        self.num_pages = num_pages
        self.page_size = page_size
