"""Radix tree over token ids at page granularity: which prefixes have KV, and in which tier.

Edges hold whole pages: a node's key is a run of tokens whose length is a multiple of the page
size. A node's KV may be on the device (`pages`), on the host (`host_pages`), or both. Both sets
are closed under prefixes: a node is on the device only if its parent is, and has a host copy
only if its parent has one, so a match is a device part followed by a host part.

Requests lock the path from their deepest device node to the root; locked device pages are never
evicted. Device eviction takes unlocked nodes with no child on the device, least recently used
first; host eviction takes host-only leaves.

A node whose pages are being copied between tiers points at that `CopyOp` (`node.copy`). While
the op has not landed the node is *busy*: its device pages are not freed (eviction is deferred
and counted) and its host pages are not reused. A pending load also makes its device pages
unreadable: `match_prefix` returns such ops so the caller waits for them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.cache.transfer import CopyOp


class RadixNode:
    __slots__ = (
        "children",
        "copy",
        "hit_count",
        "host_pages",
        "key",
        "last_access",
        "lock_ref",
        "page_keys",
        "pages",
        "parent",
    )

    def __init__(
        self, key: tuple[int, ...], pages: list[int] | None, parent: RadixNode | None
    ) -> None:
        self.key = key
        self.pages: list[int] | None = pages  # device pages; None once evicted from the device
        self.host_pages: list[int] | None = None  # host copy, if backed up
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.copy: CopyOp | None = None  # the tier copy of this node's pages, until it lands
        self.page_keys: list[str] | None = None  # storage keys of its pages, once asked for

    @property
    def on_device(self) -> bool:
        return self.pages is not None

    @property
    def busy(self) -> bool:
        """A copy of this node's pages is queued or in flight."""
        if self.copy is not None and self.copy.landed:
            self.copy = None
        return self.copy is not None

    @property
    def loading(self) -> CopyOp | None:
        """The load whose data has not reached this node's device pages yet."""
        op = self.copy
        return op if op is not None and op.kind == "load" and not op.readable else None

    @property
    def num_pages(self) -> int:
        return len(self.pages) if self.pages is not None else len(self.host_pages or ())

    def __lt__(self, other: RadixNode) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass
class PrefixMatch:
    """A cached prefix: `device_pages` for the device part (ending at `device_node`), then
    `host_nodes`, whose KV is only on the host, in prefix order."""

    device_pages: list[int]
    device_node: RadixNode
    host_nodes: list[RadixNode] = field(default_factory=list)
    loading: list[CopyOp] = field(default_factory=list)  # device part still arriving

    @property
    def host_page_count(self) -> int:
        return sum(n.num_pages for n in self.host_nodes)


class RadixCache:
    def __init__(
        self,
        page_size: int,
        free_pages: Callable[[list[int]], None],
        free_host_pages: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self._free_host_pages = free_host_pages
        self._clock = itertools.count(1)
        self.root = RadixNode((), [], None)
        self.root.host_pages = []
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_pages = 0  # device pages of unlocked nodes
        self.locked_pages = 0  # device pages of locked nodes
        self.host_pages = 0  # host pages held by nodes
        self.deferred_evictions = 0  # nodes eviction skipped because a copy was in flight

    @property
    def num_pages(self) -> int:
        """Device pages held by the tree."""
        return self.evictable_pages + self.locked_pages

    # --- lookup and insertion -------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached whole-page prefix of `tokens`, split by tier."""
        match = PrefixMatch([], self.root)
        for node, _, _ in self._walk(tokens[: len(tokens) // self.page_size * self.page_size]):
            if node.pages is not None:  # on the device
                match.device_pages.extend(node.pages)
                match.device_node = node
                if node.loading is not None:
                    match.loading.append(node.loading)
            else:
                match.host_nodes.append(node)
        return match

    def record_hit_path(self, node: RadixNode) -> None:
        """Count a use of `node` and its ancestors by an admitted request."""
        for n in self._path(node):
            n.hit_count += 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, RadixNode]:
        """Add a whole-page prefix whose KV is on the device at `pages`.

        Returns how many tokens the tree already held on the device (the caller frees its own
        pages for them) and the node that ends the prefix. Host-only nodes along the way take
        the caller's pages: they are on the device again.
        """
        ps = self.page_size
        node, end, present = self.root, 0, 0
        for node, start, end in self._walk(tokens):  # node and end live on after the loop
            if node.on_device:
                present = end
            else:
                self.set_device_pages(node, list(pages[start // ps : end // ps]))
        if end < len(tokens):
            node = self._add_leaf(node, tuple(tokens[end:]), list(pages[end // ps :]))
        return present, node

    def host_extension_start(self, tokens: Sequence[int], end_page: int) -> int | None:
        """The first whole page of `tokens[: end_page pages]` the tree does not hold, when what
        it holds ends with a host copy (so host-only pages may hang below it); else None."""
        end = end_page * self.page_size
        node, _, reached = [(self.root, 0, 0), *self._walk(tokens[:end])][-1]
        return None if node.host_pages is None else reached // self.page_size

    def insert_host(self, tokens: Sequence[int], first_page: int, host_pages: list[int]) -> int:
        """Add pages fetched from storage: whole pages `first_page ...` of `tokens`, host-only,
        below a prefix the tree holds with a host copy. Returns how many of `host_pages` (from
        the front) the tree did not take: it already held those tokens, or it no longer holds
        the prefix with a host copy (then none are taken)."""
        ps = self.page_size
        end = (first_page + len(host_pages)) * ps
        node, _, reached = [(self.root, 0, 0), *self._walk(tokens[:end])][-1]
        if reached < first_page * ps or node.host_pages is None:
            return len(host_pages)
        skip = reached // ps - first_page
        if reached < end:
            leaf = RadixNode(tuple(tokens[reached:end]), [], node)
            leaf.pages = None
            node.children[leaf.key[:ps]] = leaf
            self._touch(leaf)
            self.set_host_pages(leaf, host_pages[skip:])
        return skip

    def page_keys(
        self, node: RadixNode, chain: Callable[[str | None, Sequence[int]], list[str]]
    ) -> list[str]:
        """Storage keys of `node`'s pages: `chain(key of the page before, tokens)`, computed
        once per node, ancestors first ([] for the root)."""
        path = []
        while node is not self.root and node.page_keys is None:
            path.append(node)
            assert node.parent is not None  # only the root has none
            node = node.parent
        parent = node.page_keys[-1] if node is not self.root and node.page_keys else None
        for n in reversed(path):
            n.page_keys = chain(parent, n.key)
            parent = n.page_keys[-1]
        return (path[0] if path else node).page_keys or []

    def _walk(self, tokens: Sequence[int]) -> Iterator[tuple[RadixNode, int, int]]:
        """The nodes along the longest whole-page match of `tokens`, split where the match ends
        inside an edge: (node, start, end) with `tokens[start:end]` its key."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + self.page_size]))
            if child is None:
                return
            n = self._common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            yield child, i, i + n
            node, i = child, i + n

    def set_device_pages(self, node: RadixNode, pages: list[int]) -> None:
        """Give a host-only node a device copy again (loaded back or recomputed)."""
        assert node.pages is None and node.parent is not None and node.parent.on_device
        node.pages = pages
        if node.lock_ref:
            self.locked_pages += len(pages)
        else:
            self.evictable_pages += len(pages)

    def set_host_pages(self, node: RadixNode, host_pages: list[int]) -> None:
        assert node.host_pages is None and node.parent is not None
        assert node.parent.host_pages is not None, "host copies must form a prefix"
        node.host_pages = host_pages
        self.host_pages += len(host_pages)

    def _common_length(self, key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
        n, ps = 0, self.page_size
        limit = min(len(key), len(tokens) - start)
        while n + ps <= limit and key[n : n + ps] == tuple(tokens[start + n : start + n + ps]):
            n += ps
        return n

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], pages: list[int]) -> RadixNode:
        leaf = RadixNode(key, pages, parent)
        parent.children[key[: self.page_size]] = leaf
        self._touch(leaf)
        self.evictable_pages += len(pages)
        return leaf

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after `n` tokens; the new upper half keeps its place, locks and history."""
        parent = node.parent
        assert parent is not None
        cut = n // self.page_size
        pages = node.pages[:cut] if node.pages is not None else None
        upper = RadixNode(node.key[:n], pages, parent)
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = node.host_pages[:cut], node.host_pages[cut:]
        if node.page_keys is not None:
            upper.page_keys, node.page_keys = node.page_keys[:cut], node.page_keys[cut:]
        upper.lock_ref, upper.last_access, upper.hit_count, upper.copy = (
            node.lock_ref,
            node.last_access,
            node.hit_count,
            node.copy,
        )
        parent.children[upper.key[: self.page_size]] = upper
        node.key, node.parent = node.key[n:], upper
        if node.pages is not None:
            node.pages = node.pages[cut:]
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        node.last_access = next(self._clock)

    # --- locking --------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        for n in self._path(node):
            if n.lock_ref == 0 and n.pages is not None:
                self.evictable_pages -= len(n.pages)
                self.locked_pages += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.pages is not None:
                self.evictable_pages += len(n.pages)
                self.locked_pages -= len(n.pages)

    def _path(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not self.root:
            yield node
            assert node.parent is not None
            node = node.parent

    # --- eviction -------------------------------------------------------------------------

    def device_candidates(self) -> list[RadixNode]:
        """Unlocked device nodes with no child on the device, as an LRU heap."""
        heap = [
            n
            for n in self.nodes()
            if n.on_device and n.lock_ref == 0 and not any(c.on_device for c in n.children.values())
        ]
        heapq.heapify(heap)
        return heap

    def evict(self, num_pages: int, before_drop: Callable[[RadixNode], None] | None = None) -> int:
        """Free up to `num_pages` device pages, least recently used first.

        `before_drop` may queue a backup of a node to the host first (write-back); a node with a
        host copy keeps its place in the tree, one without is removed. A node whose copy is in
        flight is skipped (counted in `deferred_evictions`): its pages are freed only once the
        copy has landed, by a later call.
        """
        heap = self.device_candidates()
        freed = 0
        while heap and freed < num_pages:
            node = heapq.heappop(heap)
            if not node.busy and before_drop is not None and node.host_pages is None:
                before_drop(node)
            if node.busy:
                self.deferred_evictions += 1
                continue
            freed += self._drop_device(node)
            parent = node.parent
            assert parent is not None  # the root is never a candidate
            if (
                parent is not self.root
                and parent.lock_ref == 0
                and not any(c.on_device for c in parent.children.values())
            ):
                heapq.heappush(heap, parent)
        return freed

    def _drop_device(self, node: RadixNode) -> int:
        assert node.pages is not None
        freed = len(node.pages)
        self._free_pages(node.pages)
        self.evictable_pages -= freed
        node.pages = None
        if node.host_pages is None:
            self._remove(node)
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from unlocked host-only leaves, LRU first."""
        heap = [
            n
            for n in self.nodes()
            if not n.children and not n.on_device and n.lock_ref == 0 and not n.busy
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            node = heapq.heappop(heap)
            assert node.host_pages is not None  # a node off the device is in the tree for it
            freed += len(node.host_pages)
            self._drop_host(node)
            parent = node.parent
            assert parent is not None  # the root is never a candidate
            if (
                parent is not self.root
                and not parent.children
                and not parent.on_device
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, parent)
        return freed

    def _drop_host(self, node: RadixNode) -> None:
        assert self._free_host_pages is not None and node.host_pages is not None
        self._free_host_pages(node.host_pages)
        self.host_pages -= len(node.host_pages)
        node.host_pages = None
        if not node.on_device:
            self._remove(node)

    def _remove(self, node: RadixNode) -> None:
        assert not node.children and node.parent is not None
        del node.parent.children[node.key[: self.page_size]]

    def reset(self) -> int:
        """Drop every unlocked node from both tiers (flush); returns device pages freed."""
        freed = self.evict(self.evictable_pages)
        if self._free_host_pages is not None:
            self.evict_host(self.host_pages)
        return freed

    def nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
