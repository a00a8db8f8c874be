"""KV page pool, GDN state pool, host snapshot bank, page-granular radix tree and the hybrid
prefix cache."""

from deltaserve.cache.host_bank import BankUsage, HostSnapshotBank
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import (
    CacheStats,
    EvictResult,
    InsertResult,
    PrefixCache,
    PrefixMatch,
)
from deltaserve.cache.radix import RadixNode, RadixTree
from deltaserve.cache.state_pool import GDNStatePool

__all__ = [
    "BankUsage",
    "CacheStats",
    "EvictResult",
    "GDNStatePool",
    "HostSnapshotBank",
    "InsertResult",
    "PagePool",
    "PrefixCache",
    "PrefixMatch",
    "RadixNode",
    "RadixTree",
]
