"""Per-request KV bookkeeping: match a prefix, load its host part back, grow a request's pages,
hand computed pages to the tree, offload a preempted request.

A request holds one `KVHandle`, which only this manager creates and updates. Its page table is
`pages`; the first `tree_tokens / page_size` pages belong to the radix tree (locked through
`node`), the rest are the request's own. The cache knows token ids, never the engine's types.

The tree is keyed by one key per position. Plainly that is the token there; with an EAGLE-3
draft, whose KV at a position also depends on the token after it (its input there), it is the
pair (token, next token), as SGLang keys its tree with EAGLE on: a prefix then matches only
where the draft's KV too was computed from the same tokens, and the host tier and storage,
whose keys chain the tree's, key the draft's KV correctly too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from tierserve.cache.handle import KVHandle
from tierserve.cache.pool import PageAllocator, PagedKV
from tierserve.cache.radix import RadixCache
from tierserve.cache.tiers import HostTier
from tierserve.sizing import pages_for

if TYPE_CHECKING:
    from tierserve.storage import StorageTier


def pair_keys(vocab_size: int) -> Callable[[Sequence[int]], list[int]]:
    """Position keys (token, next token) as one int each: one key fewer than tokens, since the
    last position's pair is not known yet."""

    def keys(tokens: Sequence[int]) -> list[int]:
        return [a * vocab_size + b for a, b in itertools.pairwise(tokens)]

    return keys


class KVCacheManager:
    def __init__(
        self,
        pool: PagedKV,
        enable_radix_cache: bool,
        host: HostTier | None = None,
        keys: Callable[[Sequence[int]], Sequence[int]] | None = None,
    ):
        self.pool = pool
        self.keys = keys or (lambda tokens: tokens)  # a sequence's position keys
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.host = host
        self.radix: RadixCache | None = None
        if enable_radix_cache:
            free_host = host.allocator.free if host else None
            self.radix = RadixCache(self.page_size, self.allocator.free, free_host)
        if host is not None:
            host.radix = self.radix
        self.storage: StorageTier | None = host.storage if host is not None else None

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def available_pages(self) -> int:
        """Pages free now or after evicting every unlocked tree node (waiting for copies)."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    # --- the step's copies ------------------------------------------------------------------

    def poll(self) -> None:
        """Observe copies that landed and pages fetched from storage: the one point in a step
        where completion is seen."""
        if self.host is not None:
            self.host.poll()
        if self.storage is not None:
            for pf, start, payloads in self.storage.reads.take():
                self._place_fetched(pf.tokens, pf.first_page + start, payloads)

    def issue(self) -> None:
        """Start the step's batched backup and load."""
        if self.host is not None:
            self.host.issue()

    # --- admission --------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> KVHandle:
        """A handle on the longest cached prefix of `tokens`, all of it locked; its host part
        stays on the host until `load_back`."""
        if self.radix is None:
            return KVHandle()
        # The last token is always recomputed: its logits give the next token.
        m = self.radix.match_prefix(self.keys(tokens)[: len(tokens) - 1])
        host_nodes = m.host_nodes if self.host else []
        h = KVHandle(pages=list(m.device_pages), waiting=list(m.loading))
        h.node = host_nodes[-1] if host_nodes else m.device_node
        self.radix.lock(h.node)  # host nodes too: making room must not evict any of it
        h.tree_tokens = h.computed = h.device_hit = len(h.pages) * self.page_size
        h.host_nodes = host_nodes
        h.host_hit = (m.host_page_count if self.host else 0) * self.page_size
        return h

    # --- the storage tier -------------------------------------------------------------------

    def wait_for_storage(self, tokens: Sequence[int], h: KVHandle, busy: bool) -> bool:
        """Whether a request matched as `h` should stay out of this step while its prefix is
        fetched from storage. A request joins the prefetch already fetching its next page, or
        starts one when the miss is at least the threshold, provided the cached part ends with
        a host copy for the fetched pages to hang from; the prefetch policy says how long to
        wait."""
        storage, radix, ps = self.storage, self.radix, self.page_size
        if storage is None or radix is None:
            return False
        tokens = self.keys(tokens)
        whole = (len(tokens) - 1) // ps * ps  # the last token is recomputed anyway
        have = h.computed + h.host_hit
        if whole - have < ps:
            return False
        if h.node is not None and h.node is not radix.root and h.node.host_pages is None:
            return False  # a device-only prefix: host copies must form a prefix of the tree
        last = radix.page_keys(h.node, storage.namespace.chain) if h.node else []
        pf = storage.reads.start(tokens[:whole], have // ps, last[-1] if last else None)
        if pf is None:
            return False
        if storage.reads.should_wait(pf, busy):
            return True
        storage.reads.end(pf)
        return False

    def _place_fetched(
        self, tokens: tuple[int, ...], first_page: int, payloads: list[bytes | None]
    ) -> None:
        """Fetched pages into free host pages and the tree (host-only). Pages the tree holds
        by now are skipped before any host page is taken; all are dropped (and counted) when
        the tree no longer holds the prefix they follow with a host copy, or the host is full."""
        assert self.host is not None and self.radix is not None and self.storage is not None
        n, host, radix = len(payloads), self.host, self.radix
        start = radix.host_extension_start(tokens, first_page + n)
        if start is None or start < first_page or start >= first_page + n:
            self.storage.stats.add(dropped_prefetch_pages=n)
            return
        payloads = payloads[start - first_page :]
        need = len(payloads)
        if host.allocator.num_free < need:
            freed = radix.evict_host(need - host.allocator.num_free)
            host.stats.host_evicted_tokens += freed * self.page_size
        pages = host.allocator.alloc(need)
        if pages is None:
            self.storage.stats.add(dropped_prefetch_pages=n)
            return
        if payloads[0] is not None:  # None: the rank filling this shared host copy writes it
            # All or none are None (Prefetcher._hand_over): here every one is bytes.
            host.host_pool.write_page_bytes(pages, cast("list[bytes]", payloads))
        if host.share is not None:  # loads of these pages wait for that rank at a barrier
            host.share.backed_up = True
        unused = radix.insert_host(tokens, start, pages)  # 0 unless eviction took the prefix
        host.allocator.free(pages[:unused])
        self.storage.stats.add(hit_pages=need - unused, dropped_prefetch_pages=n - need + unused)

    def load_back(self, h: KVHandle) -> bool:
        """Queue the host part's copy to the device; False (it stays behind) if no room."""
        # A host part was matched: there is a host tier, a tree, and a locked node.
        assert self.radix is not None and self.host is not None and h.node is not None
        pages = self._alloc(h.host_hit // self.page_size)
        if pages is None:
            self.radix.unlock(h.node)
            h.node = parent = h.host_nodes[0].parent
            assert parent is not None  # a host node is never the root
            self.radix.lock(parent)
            return False
        op, pages = self.host.load_back(h.host_nodes, pages)
        h.waiting.append(op)
        h.pages += pages
        h.tree_tokens = h.computed = len(h.pages) * self.page_size
        h.loaded = True
        return True

    def commit(self, h: KVHandle, first_admission: bool) -> None:
        """The request was admitted with `h`: count it (selective write-through uses it).

        Hit statistics count first admissions only, as `cached_tokens` does: a preempted
        request's return is not a new request."""
        if self.radix is None or h.node is None:
            return
        self.radix.record_hit_path(h.node)
        if self.host is None:
            return
        self.host.backup_hot(h.node)
        if first_admission:
            self.host.stats.device_hit_tokens += h.device_hit
            self.host.stats.host_hit_tokens += h.host_hit if h.loaded else 0

    # --- growth and eviction ----------------------------------------------------------------

    def grow(self, h: KVHandle, num_tokens: int) -> bool:
        """Give `h` pages for its first `num_tokens` tokens; False when memory is short."""
        need = pages_for(num_tokens, self.page_size) - len(h.pages)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        h.pages.extend(pages)
        return True

    def shrink(self, h: KVHandle, num_tokens: int) -> None:
        """Free `h`'s pages past its first `num_tokens` tokens (a verified draft's rejected
        slots); pages the tree owns stay."""
        keep = max(pages_for(num_tokens, self.page_size), h.tree_tokens // self.page_size)
        self.allocator.free(h.pages[keep:])
        del h.pages[keep:]

    def advance(self, h: KVHandle, num_tokens: int) -> None:
        """`num_tokens` more of the sequence have their KV in the pool."""
        h.computed += num_tokens

    def _alloc(self, n: int) -> list[int] | None:
        if self.allocator.num_free < n and self.radix is not None:
            self._evict(n - self.allocator.num_free)
            if self.allocator.num_free < n and self.host is not None and self.host.has_pending():
                # Pages whose copies are still on the way are needed now: wait for them.
                self.host.drain()
                self._evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def _evict(self, n: int) -> None:
        assert self.radix is not None
        hook = self.host.before_device_drop if self.host else None
        freed = self.radix.evict(n, before_drop=hook)
        if self.host:
            self.host.stats.device_evicted_tokens += freed * self.page_size

    # --- handing pages to the tree ----------------------------------------------------------

    def cache_prefix(self, h: KVHandle, tokens: Sequence[int]) -> None:
        """Move the handle's computed whole pages into the tree so others can share them."""
        self._cache_prefix(h, self.keys(tokens))

    def _cache_prefix(self, h: KVHandle, tokens: Sequence[int]) -> None:
        # A verified draft may have computed past a stop token that ended the request.
        n = min(h.computed, len(tokens)) // self.page_size * self.page_size
        if self.radix is None or n <= h.tree_tokens:
            return
        ps = self.page_size
        tokens = tokens[:n]
        present, node = self.radix.insert(tokens, h.pages[: n // ps])
        # Another request inserted [tree_tokens, present) first: keep its pages, free ours.
        self.allocator.free(h.pages[h.tree_tokens // ps : present // ps])
        m = self.radix.match_prefix(tokens)
        assert m.device_node is node and not m.host_nodes
        h.pages[: len(m.device_pages)] = m.device_pages
        h.waiting += m.loading  # those pages may still be arriving from the host
        self.radix.lock(node)
        self._unlock(h)
        h.node, h.tree_tokens = node, n
        if self.host is not None:
            self.host.after_insert(node)

    def offload(self, h: KVHandle, tokens: Sequence[int]) -> bool:
        """Preemption by offload: keep a preempted request's KV on the host; True if it is."""
        if self.host is None or self.radix is None:
            return False
        self._cache_prefix(h, self.keys(tokens))
        return h.node is not None and self.host.backup(h.node)

    def release(self, h: KVHandle, tokens: Sequence[int], keep_in_cache: bool) -> KVHandle:
        """Free a finished (kept in cache) or preempted (dropped) request's KV; returns the
        empty handle it holds from now on."""
        if keep_in_cache:
            self.cache_prefix(h, tokens)
        self.allocator.free(h.pages[h.tree_tokens // self.page_size :])
        self._unlock(h)
        return KVHandle()

    def _unlock(self, h: KVHandle) -> None:
        if h.node is not None and self.radix is not None:
            self.radix.unlock(h.node)

    # --- inspection -------------------------------------------------------------------------

    def flush(self) -> dict[str, int | str]:
        """Drop every cached page no request holds, from the device and host tiers; what each
        tier did. Storage is left alone: other servers may share it, and surviving a restart
        is what it is for (its cap and LRU bound it)."""
        if self.host is not None:
            self.host.drain()  # nothing may be dropped while a copy of it is on the way
        host_before = self.radix.host_pages if self.radix else 0
        device = self.radix.reset() if self.radix else 0
        report: dict[str, int | str] = {"device_pages": device}
        if self.host is not None and self.radix is not None:
            report["host_pages"] = host_before - self.radix.host_pages
        if self.storage is not None:
            report["storage"] = "kept: shared with other servers and across restarts"
        return report

    def cached_pages(self) -> int:
        return self.radix.num_pages if self.radix else 0

    def check_accounting(self, live: list[KVHandle]) -> None:
        """Every page is free, in the tree, or owned by exactly one live request."""
        owned = sum(len(h.pages) - h.tree_tokens // self.page_size for h in live)
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
