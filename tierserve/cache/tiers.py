"""The host tier: a host KV pool under the radix tree, its write policy and its statistics.

Write policies, as in SGLang HiCache:
- write_through: a node is copied to the host as soon as it enters the tree;
- write_through_selective: once it has been hit `selective_threshold` times;
- write_back: only when it is evicted from the device (the copy finishes before the free).
A node is copied together with any ancestors that lack a host copy, so host copies always form
a prefix of the tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tierserve.cache.pool import KVPool, PageAllocator
from tierserve.cache.radix import RadixCache, RadixNode
from tierserve.cache.transfer import KVTransfer

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class TierStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_written_tokens: int = 0
    load_backs: int = 0
    load_back_tokens: int = 0
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    host_write_failures: int = (
        0  # no host room even after host eviction: the node stays device-only
    )


class HostTier:
    def __init__(
        self,
        device_pool: KVPool,
        host_pool: KVPool,
        write_policy: str,
        num_layers: int,
        selective_threshold: int = 2,
    ) -> None:
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.allocator = PageAllocator(host_pool.num_pages)
        self.transfer = KVTransfer(device_pool, host_pool, num_layers)
        self.write_policy = write_policy
        self.selective_threshold = selective_threshold
        self.stats = TierStats()
        self.radix: RadixCache | None = None  # set by the manager that owns both

    # --- device -> host ---------------------------------------------------------------------

    def backup(self, node: RadixNode) -> bool:
        """Copy `node` and its ancestors without a host copy to the host; False if no room."""
        assert self.radix is not None
        path = []
        while node is not self.radix.root and node.host_pages is None:
            path.append(node)
            node = node.parent
        path.reverse()
        need = sum(len(n.pages) for n in path)
        if need == 0:
            return True
        if self.allocator.num_free < need:
            freed = self.radix.evict_host(need - self.allocator.num_free)
            self.stats.host_evicted_tokens += freed * self.page_size
        host_pages = self.allocator.alloc(need)
        if host_pages is None:
            self.stats.host_write_failures += 1
            return False
        device_pages = [p for n in path for p in n.pages]
        self.transfer.to_host(device_pages, host_pages)
        for n in path:
            self.radix.set_host_pages(n, host_pages[: len(n.pages)])
            host_pages = host_pages[len(n.pages) :]
        self.stats.host_written_tokens += need * self.page_size
        return True

    def after_insert(self, node: RadixNode) -> None:
        if self.write_policy == "write_through":
            self.backup(node)
        elif self.write_policy == "write_through_selective":
            self.backup_hot(node)

    def backup_hot(self, node: RadixNode) -> None:
        """write_through_selective: back up the deepest node on the path hit often enough."""
        if self.write_policy != "write_through_selective":
            return
        while node is not self.radix.root and node.hit_count < self.selective_threshold:
            node = node.parent
        if node is not self.radix.root and node.on_device:
            self.backup(node)

    def before_device_drop(self, node: RadixNode) -> None:
        """Eviction hook: under write_back, a node leaving the device goes to the host first."""
        if self.write_policy == "write_back":
            self.backup(node)

    # --- host -> device ---------------------------------------------------------------------

    def load_back(self, nodes: list[RadixNode], device_pages: list[int]) -> None:
        """Copy host-only `nodes` (in prefix order) into `device_pages` and put them back on
        the device in the tree."""
        assert self.radix is not None
        start = time.perf_counter()
        host_pages = [p for n in nodes for p in n.host_pages]
        self.transfer.to_device(host_pages, device_pages)
        for n in nodes:
            size = len(n.host_pages)
            self.radix.set_device_pages(n, device_pages[:size])
            device_pages = device_pages[size:]
        tokens = len(host_pages) * self.page_size
        self.stats.load_backs += 1
        self.stats.load_back_tokens += tokens
        self.stats.load_back_bytes += len(host_pages) * self.host_pool.bytes_per_page
        self.stats.load_back_seconds += time.perf_counter() - start

    @property
    def used_pages(self) -> int:
        return self.host_pool.num_pages - self.allocator.num_free
