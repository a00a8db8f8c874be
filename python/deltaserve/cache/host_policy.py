"""Which host snapshot a full bank gives up: least recently used first, spread kept per path.

The prefix cache moves evicted device snapshots into the host bank; when the bank is full one
host snapshot must go first (or the device snapshot being evicted is dropped instead, if it is
the one this order picks). The order, lowest key first:

1. `last_access`: the least recently used path goes first.
2. Among snapshots tied on it (one path touched together), the deepest tied snapshot (no
   snapshot, on either tier, below it with the same last access) is kept until the others of
   the tie are gone: it is the longest reusable prefix of that path.
3. Then the smallest gap to the next shallower snapshot on the path (either tier, or the
   root at depth 0), so the snapshots that stay are spread out along the path; shallower first
   on an equal gap (uniform snapshots thin out to every second one, then every fourth...).

Keys only grow while an eviction runs (snapshots are removed or change tier, never added;
times and depths do not change), so a heap with lazy re-keying on pop gives the exact order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from deltaserve.cache.radix import RadixNode

DropKey = tuple[float, bool, int, int, int]


def drop_key(node: RadixNode) -> DropKey:
    """(last_access, kept, gap, depth, uid) of snapshot-holding `node`: lowest drops first.
    Cost: O(nodes above it) for the gap plus O(nodes below it touched at the same time)."""
    above = node.parent
    while above is not None and not above.has_snapshot:
        above = above.parent
    gap = node.depth - (above.depth if above is not None else 0)
    return (node.last_access, not _tied_snapshot_below(node), gap, node.depth, node.uid)


def _tied_snapshot_below(node: RadixNode) -> bool:
    # last_access never grows going down, so the tied descendants are a connected subtree
    t = node.last_access
    stack = [c for c in node.children.values() if c.last_access == t]
    while stack:
        n = stack.pop()
        if n.has_snapshot:
            return True
        stack.extend(c for c in n.children.values() if c.last_access == t)
    return False


class HostDropQueue:
    """The unlocked host snapshots of a tree in drop order, for one eviction call.

    Valid while the tree only loses snapshots or moves them between tiers (no insert, match
    or lock in between); nodes that lost their host snapshot are skipped when they surface.
    `key` is `drop_key` (a parameter so that tests can break it).
    """

    def __init__(self, nodes: Iterable[RadixNode],
                 key: Callable[[RadixNode], DropKey] = drop_key) -> None:
        self._key = key
        self._heap = [(key(n), n) for n in nodes if self._candidate(n)]
        heapq.heapify(self._heap)

    @staticmethod
    def _candidate(node: RadixNode) -> bool:
        return node.host_slot is not None and node.lock_count == 0

    def push(self, node: RadixNode) -> None:
        """Add `node`, just given a host snapshot."""
        assert self._candidate(node)
        heapq.heappush(self._heap, (self._key(node), node))

    def _top(self) -> tuple[DropKey, RadixNode] | None:
        """The current first entry, re-keyed until its stored key is exact."""
        heap = self._heap
        while heap:
            key, node = heap[0]
            if not self._candidate(node):
                heapq.heappop(heap)
                continue
            now = self._key(node)
            if now == key:
                return key, node
            heapq.heapreplace(heap, (now, node))  # its key grew: it may sink
        return None

    def pick(self, incoming: RadixNode) -> RadixNode:
        """The snapshot to give up so that device snapshot `incoming` can move in: the first
        host snapshot in drop order (removed from the queue), or `incoming` itself when it
        comes first or no host snapshot is unlocked."""
        top = self._top()
        if top is None or self._key(incoming) < top[0]:
            return incoming
        heapq.heappop(self._heap)
        return top[1]
