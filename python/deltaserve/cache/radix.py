"""A page-granular radix tree over integer keys (token ids or packed lookahead pairs).

Every edge holds a multiple of `page_size` keys and the page ids for them, so a node always
ends on a page boundary and its depth (keys from the root) is a multiple of `page_size`.
Children are indexed by the keys of their edge's first page: two children of a node differ
within that page (a fork inside a page is rounded down to the page boundary: KV for a
partially shared page cannot be shared).

Nodes also carry what the prefix cache needs: a lock count, a last-access time and at most
one GDN snapshot, valid at the node's depth (the state after exactly the node's keys): on the
device (`snapshot_slot`, a GDNStatePool slot) or in the host bank (`host_slot`, a
HostSnapshotBank slot), never both. The tree keeps counters of its pages and snapshots per
tier, locked and total, so the evictable amount is O(1); `check_integrity` recomputes them.

Node identity is stable: a split creates a new *upper* node, so a node object held by a
lock holder keeps its depth, its pages' suffix and its snapshot.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge (keys and pages from the parent) and the node at its end."""

    uid: int  # creation order, unique per tree: deterministic tie-break for LRU
    parent: RadixNode | None
    keys: list[int]  # len a multiple of page_size (0 only for the root)
    pages: list[int]  # len(keys) // page_size page ids
    depth: int  # keys from the root to the end of this edge
    last_access: float = 0
    lock_count: int = 0
    snapshot_slot: int | None = None  # device snapshot (GDNStatePool slot)
    host_slot: int | None = None  # host snapshot (HostSnapshotBank slot); never with the above
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def has_snapshot(self) -> bool:
        """A snapshot on either tier."""
        return self.snapshot_slot is not None or self.host_slot is not None

    def path(self) -> Iterator[RadixNode]:
        """This node and its ancestors up to (excluding) the root, deepest first."""
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return (f"RadixNode(uid={self.uid}, depth={self.depth}, edge={len(self.keys)}, "
                f"lock={self.lock_count}, t={self.last_access}, snap={self.snapshot_slot}, "
                f"host={self.host_slot})")


class RadixTree:
    """The tree structure and its bookkeeping; policy (what to evict, snapshot rules) lives in
    PrefixCache. Lengths and depths are in keys; `page_size` keys per page."""

    def __init__(self, page_size: int) -> None:
        assert page_size >= 1
        self.page_size = page_size
        self._uids = itertools.count()
        self.root = RadixNode(next(self._uids), None, [], [], 0)
        self.pages: set[int] = set()  # every page id the tree owns
        # every device / host (bank) snapshot slot the tree owns -> its node, so slot eviction
        # looks at snapshot nodes only, not the whole tree (a split keeps a node's snapshot)
        self.slots: dict[int, RadixNode] = {}
        self.host_slots: dict[int, RadixNode] = {}
        self.num_locked_pages = 0
        self.num_locked_slots = 0
        self.num_locked_host_slots = 0

    # ---- lookup -------------------------------------------------------------------------
    def _child(self, node: RadixNode, keys: list[int], pos: int) -> RadixNode | None:
        head = tuple(keys[pos:pos + self.page_size])
        return node.children.get(head) if len(head) == self.page_size else None

    def _common(self, edge: list[int], keys: list[int], pos: int) -> int:
        """Length of the common prefix of `edge` and `keys[pos:]`, rounded down to pages."""
        n = min(len(edge), len(keys) - pos)
        if edge[:n] == keys[pos:pos + n]:  # the common case, compared in C
            return n - n % self.page_size
        i = 0
        while i < n and edge[i] == keys[pos + i]:
            i += 1
        return i - i % self.page_size

    def match_path(self, keys: list[int]) -> list[RadixNode]:
        """Nodes (root excluded, shallowest first) whose whole edge matches a prefix of
        `keys`. Pure: no touch, no split."""
        path, node, pos = [], self.root, 0
        while (child := self._child(node, keys, pos)) is not None:
            if self._common(child.keys, keys, pos) < len(child.keys):
                break
            path.append(child)
            node, pos = child, pos + len(child.keys)
        return path

    def path_len(self, keys: list[int]) -> int:
        """How many leading `keys` the tree caches, rounded down to pages (into an edge where
        the path forks inside it). Pure: no touch, no split."""
        path = self.match_path(keys)
        node = path[-1] if path else self.root
        child = self._child(node, keys, node.depth)
        return node.depth + (self._common(child.keys, keys, node.depth) if child else 0)

    def path_pages(self, node: RadixNode) -> list[int]:
        """Page ids covering keys [0, node.depth)."""
        chunks = [n.pages for n in node.path()]
        return [p for chunk in reversed(chunks) for p in chunk]

    def path_keys(self, node: RadixNode) -> list[int]:
        chunks = [n.keys for n in node.path()]
        return [k for chunk in reversed(chunks) for k in chunk]

    def nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- mutation -----------------------------------------------------------------------
    def touch(self, node: RadixNode, now: float) -> None:
        """Set the last-access time of `node` and its ancestors to `now`."""
        for n in node.path():
            n.last_access = now
        self.root.last_access = now

    def split(self, node: RadixNode, offset: int) -> RadixNode:
        """Cut `node`'s edge after `offset` keys (0 < offset < edge, a page multiple) and
        return the new upper node. `node` keeps its identity, depth, snapshot and lock count;
        the upper node gets the same lock count and time, no snapshot."""
        ps = self.page_size
        assert 0 < offset < len(node.keys) and offset % ps == 0, (offset, len(node.keys))
        parent = node.parent
        assert parent is not None
        upper = RadixNode(next(self._uids), parent, node.keys[:offset], node.pages[:offset // ps],
                          node.depth - len(node.keys) + offset, node.last_access,
                          node.lock_count)
        parent.children[tuple(node.keys[:ps])] = upper
        node.keys, node.pages, node.parent = node.keys[offset:], node.pages[offset // ps:], upper
        upper.children[tuple(node.keys[:ps])] = node
        return upper

    def insert(self, keys: list[int], pages: list[int],
               now: float) -> tuple[RadixNode, list[int]]:
        """Make the path for `keys` exist (splitting where it forks) and touch it.

        `len(keys)` is a page multiple and `pages[i]` the caller's page for keys
        [i*page_size, (i+1)*page_size). New positions take the caller's pages (the tree owns
        them now); where the tree already had a page, a caller page that differs is returned
        (the caller frees it), an equal one (the caller got it from the tree) is not.
        Returns (node at depth len(keys), caller pages not taken).
        """
        ps = self.page_size
        assert len(keys) % ps == 0 and len(pages) == len(keys) // ps, (len(keys), len(pages))
        node, pos, foreign = self.root, 0, []
        while pos < len(keys):
            child = self._child(node, keys, pos)
            if child is None:
                new = pages[pos // ps:]
                assert self.pages.isdisjoint(new), f"insert of pages the tree owns: {new}"
                assert len(set(new)) == len(new), f"a page given twice: {new}"
                child = RadixNode(next(self._uids), node, keys[pos:], new, len(keys))
                node.children[tuple(keys[pos:pos + ps])] = child
                self.pages.update(new)
                node, pos = child, len(keys)
                break
            m = self._common(child.keys, keys, pos)
            if m < len(child.keys):
                child = self.split(child, m)
            given_pages = pages[pos // ps:pos // ps + len(child.pages)]
            for have, given in zip(child.pages, given_pages, strict=True):
                if have != given:
                    assert given not in self.pages, f"page {given} is owned by the tree"
                    foreign.append(given)
            node, pos = child, pos + m
        self.touch(node, now)
        return node, foreign

    def node_at(self, keys: list[int], depth: int) -> RadixNode:
        """The node ending at `depth` on the (existing) path of `keys`, splitting an edge if
        `depth` falls inside it. `depth` is a page multiple, 0 < depth <= matched length."""
        node = self.root
        while node.depth < depth:
            child = self._child(node, keys, node.depth)
            assert child is not None and child.depth - len(child.keys) == node.depth
            assert self._common(child.keys, keys, node.depth) >= min(
                len(child.keys), depth - node.depth), "node_at off the inserted path"
            if child.depth > depth:
                return self.split(child, depth - node.depth)
            node = child
        assert node.depth == depth, (node.depth, depth)
        return node

    def set_snapshot(self, node: RadixNode, slot: int, host: bool = False) -> None:
        """Attach device `slot` (or bank slot, with `host`) to snapshot-less, non-root `node`;
        the tree owns it now."""
        assert not node.is_root and not node.has_snapshot, f"{node} has a snapshot already"
        owned = self.host_slots if host else self.slots
        assert slot not in owned, f"{'host ' * host}slot {slot} is already a tree snapshot"
        owned[slot] = node
        if host:
            node.host_slot = slot
            self.num_locked_host_slots += node.lock_count > 0
        else:
            node.snapshot_slot = slot
            self.num_locked_slots += node.lock_count > 0

    def clear_snapshot(self, node: RadixNode) -> tuple[int | None, int | None]:
        """Detach `node`'s snapshot, on whichever tier; return (device slot, host slot), one
        of them None (the caller owns the other now)."""
        dev, host = node.snapshot_slot, node.host_slot
        assert (dev is None) != (host is None), f"{node} holds no snapshot"
        locked = node.lock_count > 0
        if dev is not None:
            del self.slots[dev]
            self.num_locked_slots -= locked
        else:
            del self.host_slots[host]
            self.num_locked_host_slots -= locked
        node.snapshot_slot = node.host_slot = None
        return dev, host

    def remove_leaf(self, leaf: RadixNode) -> list[int]:
        """Detach unlocked, snapshot-less, non-root leaf `leaf`; return its pages (the caller
        owns them now). Its parent may become a leaf."""
        assert leaf.is_leaf and not leaf.is_root and leaf.lock_count == 0
        assert not leaf.has_snapshot, "clear the snapshot before removing the node"
        parent = leaf.parent
        assert parent is not None
        del parent.children[tuple(leaf.keys[:self.page_size])]
        self.pages.difference_update(leaf.pages)
        return leaf.pages

    def lock(self, node: RadixNode) -> None:
        """Add one lock to `node` and every ancestor (root included)."""
        for n in node.path():
            if n.lock_count == 0:
                self.num_locked_pages += len(n.pages)
                self.num_locked_slots += n.snapshot_slot is not None
                self.num_locked_host_slots += n.host_slot is not None
            n.lock_count += 1
        self.root.lock_count += 1

    def unlock(self, node: RadixNode) -> None:
        """Remove one lock from `node` and every ancestor; asserts `node` holds one."""
        assert node.lock_count > 0, f"unlock of unlocked {node}"
        for n in node.path():
            assert n.lock_count > 0, f"lock count would go negative at {n}"
            n.lock_count -= 1
            if n.lock_count == 0:
                self.num_locked_pages -= len(n.pages)
                self.num_locked_slots -= n.snapshot_slot is not None
                self.num_locked_host_slots -= n.host_slot is not None
        self.root.lock_count -= 1

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Structure and counters: edges page-aligned and non-empty, depths and child index
        consistent, each lock count >= 0 and >= the sum of its children's (a lock counts once
        on every node of its path), at most one snapshot tier per node, no page or slot
        (device or host) twice, counters equal to a recount."""
        ps, root = self.page_size, self.root
        assert not root.keys and not root.pages and root.depth == 0
        assert not root.has_snapshot, "the root (depth 0) never holds a snapshot"
        pages: list[int] = []
        slots: list[int] = []
        host_slots: list[int] = []
        locked = [0, 0, 0]  # pages, device slots, host slots of locked nodes
        stack = [root]
        while stack:
            node = stack.pop()
            assert node.lock_count >= 0, f"negative lock count: {node}"
            assert node.lock_count >= sum(c.lock_count for c in node.children.values()), (
                f"lock count below its children's: {node}")
            for head, child in node.children.items():
                assert child.parent is node, f"parent link broken: {child}"
                assert child.keys, f"empty non-root node: {child}"
                assert len(child.keys) % ps == 0, f"edge not page-aligned: {child}"
                assert len(child.pages) * ps == len(child.keys), f"pages/keys mismatch: {child}"
                assert head == tuple(child.keys[:ps]), f"child indexed by a wrong key: {child}"
                assert child.depth == node.depth + len(child.keys), f"bad depth: {child}"
                stack.append(child)
            if node is root:
                continue
            assert node.snapshot_slot is None or node.host_slot is None, (
                f"a snapshot on both tiers: {node}")
            pages.extend(node.pages)
            if node.snapshot_slot is not None:
                slots.append(node.snapshot_slot)
            if node.host_slot is not None:
                host_slots.append(node.host_slot)
            if node.lock_count > 0:
                locked[0] += len(node.pages)
                locked[1] += node.snapshot_slot is not None
                locked[2] += node.host_slot is not None
        assert len(set(pages)) == len(pages), "a page is owned by two positions of the tree"
        assert len(set(slots)) == len(slots), "a slot is the snapshot of two nodes"
        assert len(set(host_slots)) == len(host_slots), "a host slot is the snapshot of two nodes"
        assert set(pages) == self.pages, f"page set drifted: {set(pages) ^ self.pages}"
        assert set(slots) == set(self.slots), f"slot set drifted: {set(slots) ^ set(self.slots)}"
        assert set(host_slots) == set(self.host_slots), (
            f"host slot set drifted: {set(host_slots) ^ set(self.host_slots)}")
        for owned, attr in ((self.slots, "snapshot_slot"), (self.host_slots, "host_slot")):
            for slot, node in owned.items():
                assert getattr(node, attr) == slot, f"slot {slot} maps to {node}"
        counters = [self.num_locked_pages, self.num_locked_slots, self.num_locked_host_slots]
        assert locked == counters, f"locked counters drifted: {locked} vs {counters}"
