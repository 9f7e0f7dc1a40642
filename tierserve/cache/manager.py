"""Request-level KV bookkeeping: match a prefix, load its host part back, grow a request's
pages, hand computed pages to the tree, offload a preempted request.

A request's page table is `pages`; its first `tree_tokens / page_size` pages belong to the radix
tree (locked through `node` while the request runs), the rest are the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierserve.cache.pool import KVPool, PageAllocator, pages_for
from tierserve.cache.radix import RadixCache, RadixNode
from tierserve.cache.tiers import HostTier

if TYPE_CHECKING:
    from tierserve.engine.request import Request


@dataclass
class PrefixHit:
    """A request's cached prefix: a device part, then a host part not yet loaded back."""

    device_tokens: int
    host_nodes: list[RadixNode] = field(default_factory=list)
    host_tokens: int = 0
    loaded: bool = False  # whether the host part made it back to the device

    @property
    def tokens(self) -> int:
        return self.device_tokens + (self.host_tokens if self.loaded else 0)


class KVCacheManager:
    def __init__(
        self, pool: KVPool, enable_radix_cache: bool, host: HostTier | None = None
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.host = host
        self.radix: RadixCache | None = None
        if enable_radix_cache:
            free_host = host.allocator.free if host else None
            self.radix = RadixCache(self.page_size, self.allocator.free, free_host)
        if host is not None:
            host.radix = self.radix

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def available_pages(self) -> int:
        """Pages free now or after evicting every unlocked tree node."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    # --- admission --------------------------------------------------------------------------

    def match(self, req: Request) -> PrefixHit:
        """Attach the longest cached prefix to a request being admitted and lock all of it;
        its host part stays on the host until `load_back`."""
        if self.radix is None:
            return PrefixHit(0)
        # The last token is always recomputed: its logits give the next token.
        m = self.radix.match_prefix(req.all_ids[: len(req.all_ids) - 1])
        host_nodes = m.host_nodes if self.host else []
        req.pages = list(m.device_pages)
        req.node = host_nodes[-1] if host_nodes else m.device_node
        self.radix.lock(req.node)  # host nodes too: making room must not evict any of it
        req.tree_tokens = req.num_computed = len(req.pages) * self.page_size
        host_tokens = (m.host_page_count if self.host else 0) * self.page_size
        return PrefixHit(req.tree_tokens, host_nodes, host_tokens)

    def load_back(self, req: Request, hit: PrefixHit) -> bool:
        """Copy the host part of `hit` to the device; False (and it stays behind) if no room."""
        pages = self._alloc(hit.host_tokens // self.page_size)
        if pages is None:
            self.radix.unlock(req.node)
            req.node = hit.host_nodes[0].parent
            self.radix.lock(req.node)
            return False
        self.host.load_back(hit.host_nodes, pages)
        req.pages += pages
        req.tree_tokens = req.num_computed = len(req.pages) * self.page_size
        hit.loaded = True
        return True

    def commit(self, req: Request, hit: PrefixHit, first_admission: bool) -> None:
        """The request was admitted with `hit`: count it (selective write-through uses it).

        Hit statistics count first admissions only, as `cached_tokens` does: a preempted
        request's return is not a new request."""
        if self.radix is None or req.node is None:
            return
        self.radix.record_hit_path(req.node)
        if self.host is None:
            return
        self.host.backup_hot(req.node)
        if first_admission:
            self.host.stats.device_hit_tokens += hit.device_tokens
            self.host.stats.host_hit_tokens += hit.host_tokens if hit.loaded else 0

    # --- growth and eviction ----------------------------------------------------------------

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens; False when memory is short."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _alloc(self, n: int) -> list[int] | None:
        if self.allocator.num_free < n and self.radix is not None:
            hook = self.host.before_device_drop if self.host else None
            freed = self.radix.evict(n - self.allocator.num_free, before_drop=hook)
            if self.host:
                self.host.stats.device_evicted_tokens += freed * self.page_size
        return self.allocator.alloc(n)

    # --- handing pages to the tree ----------------------------------------------------------

    def cache_prefix(self, req: Request) -> None:
        """Move the request's computed whole pages into the tree so others can share them."""
        n = req.num_computed // self.page_size * self.page_size
        if self.radix is None or n <= req.tree_tokens:
            return
        ps = self.page_size
        tokens = req.all_ids[:n]
        present, node = self.radix.insert(tokens, req.pages[: n // ps])
        # Another request inserted [tree_tokens, present) first: keep its pages, free ours.
        self.allocator.free(req.pages[req.tree_tokens // ps : present // ps])
        m = self.radix.match_prefix(tokens)
        assert m.device_node is node and not m.host_nodes
        req.pages[: len(m.device_pages)] = m.device_pages
        self.radix.lock(node)
        self._unlock(req)
        req.node, req.tree_tokens = node, n
        if self.host is not None:
            self.host.after_insert(node)

    def offload(self, req: Request) -> bool:
        """Preemption by offload: keep a preempted request's KV on the host; True if it is."""
        if self.host is None or self.radix is None:
            return False
        self.cache_prefix(req)
        return req.node is not None and self.host.backup(req.node)

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

    # --- inspection -------------------------------------------------------------------------

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
        if self.host is not None and self.radix is not None:
            used = self.host.used_pages
            if used != self.radix.host_pages:
                raise AssertionError(f"host leak: {used} used, tree holds {self.radix.host_pages}")
