"""Radix tree over token ids at page granularity: which prefixes already have KV, and where.

Edges hold whole pages: a node's key is a run of tokens whose length is a multiple of the page
size, and `pages` holds one page id per `page_size` tokens. Nodes in use are locked (a request
locks the path from its deepest matched node to the root); only unlocked leaves are evicted, LRU.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence


class RadixNode:
    __slots__ = ("children", "hit_count", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0

    def __lt__(self, other: RadixNode) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self._clock = itertools.count(1)
        self.root = RadixNode((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_pages = 0
        self.locked_pages = 0

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    # --- lookup and insertion -------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """Pages of the longest cached whole-page prefix of `tokens`, and its deepest node."""
        node, pages, i = self.root, [], 0
        tokens = tokens[: len(tokens) // self.page_size * self.page_size]
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + self.page_size]))
            if child is None:
                break
            n = self._common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            child.hit_count += 1
            pages.extend(child.pages)
            node, i = child, i + n
        return pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Add a whole-page prefix; returns how many of its tokens the tree already held.

        The caller owns `pages` for the part already held and should free its own copies there.
        """
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + self.page_size]))
            if child is None:
                self._add_leaf(node, tuple(tokens[i:]), list(pages[i // self.page_size :]))
                return i
            n = self._common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            node, i = child, i + n
        return i

    def _common_length(self, key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
        n, ps = 0, self.page_size
        limit = min(len(key), len(tokens) - start)
        while n + ps <= limit and key[n : n + ps] == tuple(tokens[start + n : start + n + ps]):
            n += ps
        return n

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], pages: list[int]) -> None:
        leaf = RadixNode(key, pages, parent)
        parent.children[key[: self.page_size]] = leaf
        self._touch(leaf)
        self.evictable_pages += len(pages)

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after `n` tokens; the new upper half keeps its place, locks and history."""
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[:n], node.pages[: n // self.page_size], parent)
        upper.lock_ref, upper.last_access, upper.hit_count = (
            node.lock_ref,
            node.last_access,
            node.hit_count,
        )
        parent.children[upper.key[: self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[n:], node.pages[n // self.page_size :], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        node.last_access = next(self._clock)

    # --- locking --------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        for n in self._path(node):
            if n.lock_ref == 0:
                self.evictable_pages -= len(n.pages)
                self.locked_pages += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_pages += len(n.pages)
                self.locked_pages -= len(n.pages)

    def _path(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not self.root:
            yield node
            assert node.parent is not None
            node = node.parent

    # --- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first."""
        heap = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _remove_leaf(self, leaf: RadixNode) -> int:
        assert leaf.parent is not None
        del leaf.parent.children[leaf.key[: self.page_size]]
        self._free_pages(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        return len(leaf.pages)

    def reset(self) -> int:
        """Drop every unlocked node (flush); returns the pages freed."""
        return self.evict(self.evictable_pages)

    def nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
