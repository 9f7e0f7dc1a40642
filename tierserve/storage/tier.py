"""The storage tier (L3) under the host tier: background writes of pages that reach the host,
and prefetches of prefixes that miss on device and host, both off the engine thread.

Writes: a page copied to the host tier is queued for storage (SGLang HiCache's behaviour: what
reaches the host is backed up), packed and checked against the store on a writer thread, and put
in batches. The queue is bounded: when it is full a page is dropped and counted, never waited for.

Reads (prefetch.py): a request whose uncached prefix is at least `prefetch_threshold` tokens
starts a prefetch of its pages, in order, in batches, on worker threads; the engine thread places
what every rank of its group has fetched at its next step, into the host tier, whence the request
loads them back like any host hit. How long the request waits: prefetch_policy.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD, StorageBackend
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.keys import Namespace
from tierserve.storage.objects import pack
from tierserve.storage.prefetch import FETCH_AHEAD, FETCHERS, Prefetcher, RankRoles
from tierserve.storage.prefetch_policy import DEFAULT_POLICY, PREFETCH_POLICIES, PrefetchRates
from tierserve.storage.registry import make_backend

logger = logging.getLogger("tierserve")


@dataclass(frozen=True)
class StorageConfig:
    """The tier's knobs; all but the backend's own come from the extra config JSON too."""

    backend: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: str = DEFAULT_POLICY
    timeout_s: float = 2.0  # per call into the store
    prefetch_threshold: int = 256  # tokens; a shorter miss is recomputed
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_timeout_max: float = 10.0
    prefetch_read_bytes_per_s: float = 0.0  # auto's rates, pinned; 0: measured
    prefetch_recompute_tokens_per_s: float = 0.0
    write_queue_bytes: int = 256 * 2**20  # pages waiting to be written, at most
    batch_pages: int = 64
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    miss_ttl_s: float = 1.0  # a page a prefetch stopped at is not asked for again this soon
    namespace: str = ""  # a salt: servers with different salts never share pages

    @classmethod
    def parse(
        cls, backend: str, extra_json: str | None, policy: str = DEFAULT_POLICY
    ) -> StorageConfig:
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
            _check_field(name, value)
        return cls(backend, extra, policy, **ours)

    def buffer_bytes(self, bytes_per_page: int) -> int:
        """RAM the tier itself holds at most: the write queue, and the pages fetched and not
        placed yet (each fetcher runs FETCH_AHEAD batches ahead of the engine)."""
        return self.write_queue_bytes + FETCHERS * FETCH_AHEAD * self.batch_pages * bytes_per_page

    def wait_limit(self, tokens: int) -> float:
        """timeout policy: seconds a request waits for a prefetch of `tokens` tokens."""
        limit = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(self.prefetch_timeout_max, limit)


# Fields that count things: whole numbers >= 1. The rest are seconds or tokens, >= 0.
_COUNTS = ("write_queue_bytes", "batch_pages", "breaker_failures")


def _check_field(name: str, value: Any) -> None:
    if name == "namespace":
        if not isinstance(value, str):
            raise TierserveError("namespace in the storage config must be a string", EXTRA_FIELD)
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise TierserveError(f"{name} in the storage config must be >= 0", EXTRA_FIELD)
    if name in _COUNTS and (not isinstance(value, int) or value < 1):
        raise TierserveError(f"{name} in the storage config must be an int >= 1", EXTRA_FIELD)
    if name == "timeout_s" and value == 0:
        raise TierserveError("timeout_s in the storage config must be > 0", EXTRA_FIELD)


class StorageTier:
    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        rates: PrefetchRates,
        roles: RankRoles | None = None,
    ) -> None:
        self.cfg, self.namespace, self.spec = cfg, namespace, namespace.spec
        self.rates = rates
        self.roles = roles or RankRoles()
        self.stats = StorageStats()
        self.backend: StorageBackend = make_backend(cfg.backend, cfg.extra)
        self.store = GuardedStore(
            self.backend,
            self.stats,
            cfg.timeout_s,
            failures_to_open=cfg.breaker_failures,
            cooldown_s=cfg.breaker_cooldown_s,
        )
        self.reads = Prefetcher(
            cfg.prefetch_policy, namespace, self.store, self.backend, self.stats, rates,
            self.roles, cfg.wait_limit, cfg.prefetch_threshold, cfg.batch_pages, cfg.miss_ttl_s,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._queued_bytes = 0  # bounded by cfg.write_queue_bytes (see write_room)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-writer")
        self._writer.start()

    # --- writes -----------------------------------------------------------------------------

    def write_room(self) -> int:
        """Pages the write queue takes now; the caller drops (and counts) the rest before
        reading them, so a full queue costs no copy."""
        with self._lock:
            free = self.cfg.write_queue_bytes - self._queued_bytes
        return max(0, free // self.spec.bytes_per_page)

    def write(self, keys: list[str], payloads: list[bytes]) -> None:
        """Queue pages for storage (at most `write_room()` of them); never blocks."""
        with self._lock:
            self._queued_bytes += sum(len(p) for p in payloads)
        for item in zip(keys, payloads, strict=True):
            self._writes.put_nowait(item)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            batch = [item]
            while len(batch) < self.cfg.batch_pages and not self._writes.empty():
                batch.append(self._writes.get_nowait())  # the only consumer: never empty here
            stop = batch[-1] is None
            batch = [b for b in batch if b is not None]
            self._write(batch)
            with self._lock:
                self._queued_bytes -= sum(len(p) for _, p in batch)
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
                if not found or k in self.reads.bad_keys
            }
            if todo:
                start = time.perf_counter()
                self.store.call(self.backend.put, todo)
                self.reads.bad_keys.difference_update(todo)
                self.reads.written(list(todo))  # stored now: worth asking for again
                self.stats.add(
                    written_pages=len(todo),
                    written_bytes=sum(len(b) for b in todo.values()),
                    write_seconds=time.perf_counter() - start,
                )
        except StorageUnavailable:
            self.stats.add(dropped_writes=len(batch))

    @property
    def queued_writes(self) -> int:
        """Pages queued or being written (a replica's writes have landed when this is 0)."""
        return self._writes.unfinished_tasks

    def flush_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False if time ran out."""
        end = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    def close(self) -> None:
        self.reads.close()
        with contextlib.suppress(queue.Full):
            self._writes.put_nowait(None)
        self.backend.close()  # store calls still running are daemon threads: nothing to join
