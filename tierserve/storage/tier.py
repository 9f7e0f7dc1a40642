"""The storage tier (L3) under the host tier: background writes of pages that reach the host,
and prefetches of prefixes that miss on device and host, both off the engine thread.

Writes: a page copied to the host tier is queued for storage (SGLang HiCache's behaviour: what
reaches the host is backed up), packed and checked against the store on a writer thread, and put
in batches. The queue is bounded: when it is full a page is dropped and counted, never waited for.

Reads: a request whose uncached prefix is at least `prefetch_threshold` tokens starts a prefetch
of its pages, in order, in batches: `exists`, then `get` of the consecutive pages found, each
object checked (objects.py) before it is handed over. The engine thread takes the fetched pages
at its next step (`take_fetched`) into the host tier, whence the request loads them back like any
host hit. How long the request waits before it is admitted anyway
(`--hicache-storage-prefetch-policy`):
- best_effort: while the engine has other requests to run; an idle engine admits it at once;
- wait_complete: until the prefetch ends (found all, hit a miss, or the store failed);
- timeout: until it ends or `base + per_ki_token × tokens / 1024` seconds pass (capped).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD, StorageBackend, make_backend
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.keys import Namespace
from tierserve.storage.objects import pack, unpack

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MAX_PREFETCHES = 1024


@dataclass(frozen=True)
class StorageConfig:
    """The tier's knobs; all but the backend's own come from the extra config JSON too."""

    backend: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: str = "best_effort"
    timeout_s: float = 2.0  # per call into the store
    prefetch_threshold: int = 256  # tokens; a shorter miss is recomputed
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_timeout_max: float = 10.0
    write_queue_pages: int = 4096
    batch_pages: int = 64
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    miss_ttl_s: float = 1.0  # a page a prefetch stopped at is not asked for again this soon

    @classmethod
    def parse(cls, backend: str, extra_json: str | None, policy: str) -> StorageConfig:
        try:
            extra = json.loads(extra_json) if extra_json else {}
        except ValueError as err:
            raise TierserveError(f"storage extra config is not JSON: {err}", EXTRA_FIELD) from None
        if not isinstance(extra, dict):
            raise TierserveError("storage extra config must be a JSON object", EXTRA_FIELD)
        if policy not in PREFETCH_POLICIES:
            raise TierserveError(
                f"prefetch policy {policy!r}; known: {', '.join(PREFETCH_POLICIES)}",
                "hicache_storage_prefetch_policy",
            )
        ours = {k: extra.pop(k) for k in list(extra) if k in cls.__dataclass_fields__}
        for name, value in ours.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise TierserveError(f"{name} in the storage config must be >= 0", EXTRA_FIELD)
        return cls(backend, extra, policy, **ours)

    def wait_limit(self, tokens: int) -> float:
        """timeout policy: seconds a request waits for a prefetch of `tokens` tokens."""
        limit = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(self.prefetch_timeout_max, limit)


@dataclass(eq=False)
class Prefetch:
    """Pages `first_page ...` of `tokens`, fetched in order by a worker."""

    tokens: tuple[int, ...]  # whole pages, through the last one it may fetch
    first_page: int  # pages the tree held when it started
    keys: list[str]
    deadline: float
    fetched: queue.SimpleQueue[tuple[int, list[bytes]]] = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        """Ended, and everything it fetched taken by the engine."""
        return self.done.is_set() and self.fetched.empty()


class StorageTier:
    def __init__(self, cfg: StorageConfig, namespace: Namespace) -> None:
        self.cfg, self.namespace, self.spec = cfg, namespace, namespace.spec
        self.stats = StorageStats()
        self.backend: StorageBackend = make_backend(cfg.backend, cfg.extra)
        self.store = GuardedStore(
            self.backend,
            self.stats,
            cfg.timeout_s,
            failures_to_open=cfg.breaker_failures,
            cooldown_s=cfg.breaker_cooldown_s,
        )
        self.prefetches: dict[str, Prefetch] = {}  # by the key of the first page to fetch
        self._bad_keys: set[str] = set()  # found corrupt: rewritten without asking `exists`
        # Where prefetches stopped (a page missing or damaged), so a request that goes ahead
        # after a partial prefetch does not start another one at the same page.
        self._stopped_at: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue(cfg.write_queue_pages)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-writer")
        self._writer.start()
        self._fetchers = ThreadPoolExecutor(2, thread_name_prefix="tierserve-prefetch")
        self._any_fetched = threading.Event()

    # --- writes -----------------------------------------------------------------------------

    def write(self, keys: list[str], payloads: list[bytes]) -> None:
        """Queue pages for storage; never blocks (a full queue drops and counts)."""
        for item in zip(keys, payloads, strict=True):
            try:
                self._writes.put_nowait(item)
            except queue.Full:
                self.stats.add(dropped_writes=1)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            batch = [item]
            while len(batch) < self.cfg.batch_pages and not self._writes.empty():
                batch.append(self._writes.get_nowait())  # the only consumer: never empty here
            stop = batch[-1] is None
            batch = [b for b in batch if b is not None]
            self._write(batch)
            for _ in range(len(batch) + stop):
                self._writes.task_done()
            if stop:
                return
        self._writes.task_done()

    def _write(self, batch: list[tuple[str, bytes]]) -> None:
        try:
            keys = [k for k, _ in batch]
            present = self.store.call(self.backend.exists, keys)
            todo = {
                k: pack(k, self.spec, payload)
                for (k, payload), found in zip(batch, present, strict=True)
                if not found or k in self._bad_keys
            }
            if todo:
                start = time.perf_counter()
                self.store.call(self.backend.put, todo)
                self._bad_keys.difference_update(todo)
                with self._lock:  # stored now: worth asking for again
                    for key in todo:
                        self._stopped_at.pop(key, None)
                self.stats.add(
                    written_pages=len(todo),
                    written_bytes=sum(len(b) for b in todo.values()),
                    write_seconds=time.perf_counter() - start,
                )
        except StorageUnavailable:
            self.stats.add(dropped_writes=len(batch))

    def flush_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False if time ran out."""
        end = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    # --- reads ------------------------------------------------------------------------------

    def prefetch(
        self, tokens: tuple[int, ...], first_page: int, parent_key: str | None
    ) -> Prefetch | None:
        """The prefetch of `tokens`' whole pages from `first_page` on (started if new); None
        when one stopped at that page moments ago."""
        ps = self.spec.page_size
        rest = tokens[first_page * ps :]
        # Asked every step while the request waits: hash one page to find it, not the prompt.
        first = self.namespace.chain(parent_key, rest[:ps])[0]
        running = self.prefetches.get(first)
        if running is not None:
            return running
        with self._lock:
            stopped = self._stopped_at.get(first)
        if stopped is not None and time.monotonic() - stopped < self.cfg.miss_ttl_s:
            return None  # a prefetch just stopped here (missing or damaged): do not ask again
        keys = self.namespace.chain(parent_key, rest)
        if len(self.prefetches) > MAX_PREFETCHES:  # those of aborted requests: never ended
            for key in [k for k, p in self.prefetches.items() if p.finished]:
                del self.prefetches[key]
        limit = self.cfg.wait_limit(len(keys) * ps)
        pf = Prefetch(tokens, first_page, keys, time.monotonic() + limit)
        self.prefetches[keys[0]] = pf
        self.stats.add(prefetches=1)
        self._fetchers.submit(self._fetch, pf)
        return pf

    def _fetch(self, pf: Prefetch) -> None:
        try:
            done = 0
            while done < len(pf.keys) and not pf.cancelled.is_set():
                got = self._fetch_batch(pf.keys[done : done + self.cfg.batch_pages])
                if got:
                    pf.fetched.put((done, got))
                    self._any_fetched.set()
                done += len(got)
                if len(got) < min(self.cfg.batch_pages, len(pf.keys) - done + len(got)):
                    break  # a page is missing: the pages after it cannot be used
            self.stats.add(miss_pages=len(pf.keys) - done)
            if done < len(pf.keys) and not pf.cancelled.is_set():
                with self._lock:
                    self._stopped_at[pf.keys[done]] = time.monotonic()
                    while len(self._stopped_at) > MAX_PREFETCHES:
                        self._stopped_at.popitem(last=False)
        finally:
            pf.done.set()
            self._any_fetched.set()

    def _fetch_batch(self, keys: list[str]) -> list[bytes]:
        """The payloads of the leading pages of `keys` that exist and are intact."""
        try:
            found = self.store.call(self.backend.exists, keys)
            n = found.index(False) if False in found else len(found)
            if n == 0:
                return []
            start = time.perf_counter()
            blobs = self.store.call(self.backend.get, keys[:n])
            seconds = time.perf_counter() - start
        except StorageUnavailable:
            return []
        out = []
        for key, blob in zip(keys[:n], blobs, strict=True):
            payload = unpack(blob, key, self.spec) if blob else None
            if payload is None:
                if blob:  # present but not this page: counted, rewritten when next stored
                    self.stats.add(corrupt_objects=1)
                    self._bad_keys.add(key)
                break
            out.append(payload)
        self.stats.add(read_bytes=sum(len(b) for b in blobs), read_seconds=seconds)
        return out

    def should_wait(self, pf: Prefetch, busy: bool) -> bool:
        """Whether the request behind `pf` stays out of the batch for now (the policy)."""
        if pf.finished:
            return False
        policy = self.cfg.prefetch_policy
        if policy == "best_effort":
            return busy and not pf.done.is_set()
        return not (policy == "timeout" and time.monotonic() >= pf.deadline)

    def end(self, pf: Prefetch) -> None:
        """The request went ahead: stop fetching what it will compute anyway. A prefetch is
        forgotten once ended and emptied, so a request never starts the same one twice."""
        pf.cancelled.set()
        if pf.finished and self.prefetches.get(pf.keys[0]) is pf:
            del self.prefetches[pf.keys[0]]

    def take_fetched(self) -> list[tuple[Prefetch, int, list[bytes]]]:
        """(prefetch, index of its first page in this batch, payloads) fetched since the last
        call; prefetches that ended and were emptied are forgotten."""
        self._any_fetched.clear()
        out = []
        for key, pf in list(self.prefetches.items()):
            while not pf.fetched.empty():
                start, payloads = pf.fetched.get()
                out.append((pf, start, payloads))
            if pf.done.is_set() and pf.fetched.empty() and pf.cancelled.is_set():
                del self.prefetches[key]
        return out

    def wait_for_fetches(self, timeout_s: float) -> None:
        """Block the engine thread briefly when only prefetches are left to wait for."""
        self._any_fetched.wait(timeout_s)

    def close(self) -> None:
        for pf in self.prefetches.values():
            pf.cancelled.set()
        with contextlib.suppress(queue.Full):
            self._writes.put_nowait(None)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self.store.close()
