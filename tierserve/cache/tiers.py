"""The host tier: a host page buffer under the radix tree, its write policy, its copies and stats.

Write policies, as in SGLang HiCache:
- write_through: a node is copied to the host as soon as it enters the tree;
- write_through_selective: once it has been hit `selective_threshold` times;
- write_back: only when it is evicted from the device (the device pages are freed once the copy
  has landed).
A node is copied together with any ancestors that lack a host copy, so host copies always form
a prefix of the tree.

Copies are batched: everything queued during a step becomes one backup op and one load op,
issued by `issue()`; `poll()` observes what landed (see cache/transfer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.cache.pool import PageAllocator, PagedKV
from tierserve.cache.radix import RadixCache, RadixNode
from tierserve.cache.shared_host import HostShare
from tierserve.cache.transfer import CopyOp, TransferBackend, page_runs

if TYPE_CHECKING:
    from tierserve.storage import StorageTier

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
MATCH_WORK = 20_000  # source runs × free runs beyond which pages are paired by rank


@dataclass
class TierStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_written_tokens: int = 0
    load_backs: int = 0
    load_back_tokens: int = 0
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0  # the copies' own time (CUDA: between events on the stream)
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    # No host room even after host eviction: the node stays device-only.
    host_write_failures: int = 0
    backup_batches: int = 0
    load_batches: int = 0
    forced_waits: int = 0  # device pages were needed before their copies landed


def matched_runs(src: list[int], fresh: list[int]) -> list[int]:
    """Assign the freshly allocated pages `fresh` to the pages `src` so that each run of
    consecutive source pages lands, where possible, on a run of consecutive fresh pages: a copy
    is one call per run, and short runs cost the most. Longest source runs choose first, each
    taking the smallest free run that holds it (or the longest, split)."""
    free = sorted(fresh)
    holes = [[first, n] for first, _, n in page_runs(free, free)]  # [first page, length]
    runs, start = [], 0  # [index into src, length]
    for _, _, n in page_runs(src, src):
        runs.append([start, n])
        start += n
    out = [0] * len(src)
    if len(runs) * len(holes) > MATCH_WORK:  # keep the step's Python time bounded: by rank
        for page, i in zip(free, sorted(range(len(src)), key=src.__getitem__), strict=True):
            out[i] = page
        return out
    for start, length in sorted(runs, key=lambda r: -r[1]):
        while length:
            fits = [h for h in holes if h[1] >= length]
            hole = min(fits, key=lambda h: h[1]) if fits else max(holes, key=lambda h: h[1])
            take = min(length, hole[1])
            out[start : start + take] = range(hole[0], hole[0] + take)
            hole[0] += take
            hole[1] -= take
            if not hole[1]:
                holes.remove(hole)
            start += take
            length -= take
    return out


class HostTier:
    def __init__(
        self,
        host_pool: PagedKV,
        write_policy: str,
        transfer: TransferBackend,
        selective_threshold: int = 2,
        storage: StorageTier | None = None,
        share: HostShare | None = None,
    ) -> None:
        self.host_pool = host_pool
        self.share = share  # a host copy shared with other ranks (cache/shared_host.py)
        self.page_size = host_pool.page_size
        self.allocator = PageAllocator(host_pool.num_pages)
        self.transfer = transfer
        self.write_policy = write_policy
        self.selective_threshold = selective_threshold
        self.stats = TierStats()
        self.radix: RadixCache | None = None  # set by the manager that owns both
        self._backups: CopyOp | None = None  # this step's batch, until issued
        self._loads: CopyOp | None = None
        # Below the host: what reaches the host tier is written to storage once it has landed.
        self.storage = storage
        self._to_store: list[tuple[CopyOp, list[str], list[int]]] = []

    # --- device -> host ---------------------------------------------------------------------

    def backup(self, node: RadixNode) -> bool:
        """Queue a copy of `node` and its ancestors without a host copy; False if no room."""
        assert self.radix is not None
        path = []
        while node is not self.radix.root and node.host_pages is None:
            path.append(node)
            assert node.parent is not None  # only the root has none
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
        if self._backups is None:
            self._backups = CopyOp("backup")
        device_pages = [p for n in path for p in n.pages]
        host_pages = matched_runs(device_pages, host_pages)
        self._backups.add(device_pages, host_pages)
        if self.storage is not None and self.storage.roles.writes:
            chain = self.storage.namespace.chain
            keys = [k for n in path for k in self.radix.page_keys(n, chain)]
            self._to_store.append((self._backups, keys, host_pages))
        for n in path:
            self.radix.set_host_pages(n, host_pages[: len(n.pages)])
            host_pages = host_pages[len(n.pages) :]
            n.copy = self._backups
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
        assert self.radix is not None
        while node is not self.radix.root and node.hit_count < self.selective_threshold:
            assert node.parent is not None  # only the root has none
            node = node.parent
        if node is not self.radix.root and node.on_device:
            self.backup(node)

    def before_device_drop(self, node: RadixNode) -> None:
        """Eviction hook: under write_back, a node leaving the device goes to the host first."""
        if self.write_policy == "write_back":
            self.backup(node)

    # --- host -> device ---------------------------------------------------------------------

    def load_back(self, nodes: list[RadixNode], fresh_pages: list[int]) -> tuple[CopyOp, list[int]]:
        """Queue a copy of host-only `nodes` (in prefix order) into the free device pages
        `fresh_pages`; they are on the device in the tree at once, readable when the returned
        op is. Returns the op and the device pages in prefix order (a page table's tail)."""
        assert self.radix is not None
        if self._loads is None:
            self._loads = CopyOp("load")
        host_pages: list[int] = []
        for n in nodes:
            assert n.host_pages is not None  # host-only nodes: their KV is on the host
            host_pages += n.host_pages
        device_pages = matched_runs(host_pages, fresh_pages)
        self._loads.add(host_pages, device_pages)
        rest = device_pages
        for n in nodes:
            assert n.host_pages is not None
            size = len(n.host_pages)
            self.radix.set_device_pages(n, rest[:size])
            rest = rest[size:]
            n.copy = self._loads
        self.stats.load_backs += 1
        self.stats.load_back_tokens += len(host_pages) * self.page_size
        return self._loads, device_pages

    # --- the copies' life -------------------------------------------------------------------

    def issue(self) -> None:
        """Start this step's backup batch, then its load batch."""
        for op in (self._backups, self._loads):
            if op is None:
                continue
            if self.share is not None:
                if op.kind == "load":
                    self.share.before_load(self.transfer.wait_backups)
                else:
                    self.share.backed_up = True
            self.transfer.issue(op)
        self.stats.backup_batches += self._backups is not None
        self.stats.load_batches += self._loads is not None
        self._backups = self._loads = None

    def poll(self) -> None:
        self._account(self.transfer.poll())

    def drain(self) -> None:
        """Issue what is queued and wait for every copy to land (device pages needed now)."""
        self.issue()
        self.stats.forced_waits += 1
        self._account(self.transfer.wait_all())

    def has_pending(self) -> bool:
        """Copies queued or not landed: waiting for them may free device pages."""
        return self._backups is not None or self._loads is not None or self.in_flight > 0

    @property
    def in_flight(self) -> int:
        """Copies issued and not landed yet."""
        return sum(not op.landed for op in self.transfer.in_flight)

    def _account(self, landed: list[CopyOp]) -> None:
        if self._to_store and landed:
            self._store_landed()
        nbytes = self.host_pool.spec.bytes_per_page
        for op in landed:
            if op.kind == "load":
                self.stats.load_back_bytes += op.pages * nbytes
                self.stats.load_back_seconds += op.seconds
            else:
                self.stats.backup_bytes += op.pages * nbytes
                self.stats.backup_seconds += op.seconds

    def _store_landed(self) -> None:
        """Hand pages whose host copy just landed to the storage tier (read now: the host pages
        cannot be reused before the engine thread's next decision)."""
        assert self.storage is not None
        pending = []
        for op, keys, pages in self._to_store:
            if op.landed:
                room = self.storage.write_room()  # read no more than the queue takes
                if room < len(pages):
                    self.storage.stats.add(dropped_writes=len(pages) - room)
                if room:
                    self.storage.write(keys[:room], self.host_pool.page_bytes(pages[:room]))
            else:
                pending.append((op, keys, pages))
        self._to_store = pending

    @property
    def used_pages(self) -> int:
        return self.host_pool.num_pages - self.allocator.num_free
