"""Request-level KV bookkeeping: match a prefix, grow a request's pages, hand pages to the tree.

A request's page table is `pages`; its first `tree_tokens / page_size` pages belong to the radix
tree (locked through `node` while the request runs), the rest are the request's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierserve.cache.pool import KVPool, PageAllocator, pages_for
from tierserve.cache.radix import RadixCache

if TYPE_CHECKING:
    from tierserve.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: KVPool, enable_radix_cache: bool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.radix = RadixCache(self.page_size, self.allocator.free) if enable_radix_cache else None

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def available_pages(self) -> int:
        """Pages free now or after evicting every unlocked tree node."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    def match(self, req: Request) -> int:
        """Attach the longest cached prefix to a request being admitted; returns its tokens."""
        if self.radix is None:
            return 0
        # The last token is always recomputed: its logits give the next token.
        pages, node = self.radix.match_prefix(req.all_ids[: len(req.all_ids) - 1])
        self.radix.lock(node)
        req.node, req.pages = node, list(pages)
        req.tree_tokens = req.num_computed = len(pages) * self.page_size
        return req.tree_tokens

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens; False when memory is short."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need and self.radix is not None:
            self.radix.evict(need - self.allocator.num_free)
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def cache_prefix(self, req: Request) -> None:
        """Move the request's computed whole pages into the tree so others can share them."""
        n = req.num_computed // self.page_size * self.page_size
        if self.radix is None or n <= req.tree_tokens:
            return
        tokens = req.all_ids[:n]
        present = self.radix.insert(tokens, req.pages[: n // self.page_size])
        # Another request inserted [tree_tokens, present) first: keep its pages, free ours.
        self.allocator.free(
            req.pages[req.tree_tokens // self.page_size : present // self.page_size]
        )
        pages, node = self.radix.match_prefix(tokens)
        req.pages[: len(pages)] = pages
        self.radix.lock(node)
        self._unlock(req)
        req.node, req.tree_tokens = node, n

    def release(self, req: Request, keep_in_cache: bool) -> None:
        """Free a finished (kept in cache) or preempted (dropped) request's KV."""
        if keep_in_cache:
            self.cache_prefix(req)
        self.allocator.free(req.pages[req.tree_tokens // self.page_size :])
        self._unlock(req)
        req.pages, req.node, req.tree_tokens, req.num_computed = [], None, 0, 0

    def _unlock(self, req: Request) -> None:
        if req.node is not None and self.radix is not None:
            self.radix.unlock(req.node)

    def flush(self) -> int:
        return self.radix.reset() if self.radix else 0

    def cached_pages(self) -> int:
        return self.radix.num_pages if self.radix else 0

    def check_accounting(self, live: list[Request]) -> None:
        """Every page is free, in the tree, or owned by exactly one live request."""
        owned = sum(len(r.pages) - r.tree_tokens // self.page_size for r in live)
        total = self.allocator.num_free + self.cached_pages() + owned
        if total != self.num_pages:
            raise AssertionError(
                f"page leak: free {self.allocator.num_free} + tree {self.cached_pages()} "
                f"+ requests {owned} = {total} != {self.num_pages}"
            )
