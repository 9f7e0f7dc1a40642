"""The storage tier (L3) under the host tier: background writes of pages that reach the host,
and prefetches of prefixes that miss on device and host, both off the engine thread.

Writes: a page copied to the host tier is queued for storage (SGLang HiCache's behaviour: what
reaches the host is backed up), packed and checked against the store on a writer thread, and put
in batches. The queue is bounded: when it is full a page is dropped and counted, never waited for.

Reads: a request whose uncached prefix is at least `prefetch_threshold` tokens starts a prefetch
of its pages, in order, in batches: `exists`, then `get` of the consecutive pages found, each
object checked (objects.py) before it is handed over. The engine thread takes the fetched pages
at its next step (`take_fetched`) into the host tier, whence the request loads them back like any
host hit. How long the request waits before it is admitted anyway: prefetch_policy.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD, StorageBackend
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.keys import Namespace
from tierserve.storage.objects import pack, unpack
from tierserve.storage.prefetch_policy import (
    DEFAULT_POLICY,
    PREFETCH_POLICIES,
    PrefetchRates,
    should_wait,
)
from tierserve.storage.registry import make_backend

logger = logging.getLogger("tierserve")

MAX_STOPPED = 1024  # pages where prefetches stopped, remembered for miss_ttl_s
FETCHERS = 2  # prefetches that run at once
FETCH_AHEAD = 2  # batches a prefetch fetches before the engine has placed the earlier ones


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
    def __init__(self, cfg: StorageConfig, namespace: Namespace, rates: PrefetchRates) -> None:
        self.cfg, self.namespace, self.spec = cfg, namespace, namespace.spec
        self.rates = rates
        self.stats = StorageStats()
        self.backend: StorageBackend = make_backend(cfg.backend, cfg.extra)
        self.store = GuardedStore(
            self.backend,
            self.stats,
            cfg.timeout_s,
            failures_to_open=cfg.breaker_failures,
            cooldown_s=cfg.breaker_cooldown_s,
        )
        # Prefetches not finished, by every key they cover: a request whose missing part
        # starts anywhere in one joins it instead of fetching the same pages again.
        self.prefetches: dict[str, Prefetch] = {}
        self._running: list[Prefetch] = []
        self._bad_keys: set[str] = set()  # found corrupt: rewritten without asking `exists`
        # Where prefetches stopped (a page missing or damaged), so a request that goes ahead
        # after a partial prefetch does not start another one at the same page.
        self._stopped_at: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._queued_bytes = 0  # bounded by cfg.write_queue_bytes (see write_room)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-writer")
        self._writer.start()
        self._fetchers = ThreadPoolExecutor(FETCHERS, thread_name_prefix="tierserve-prefetch")
        self._any_fetched = threading.Event()

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

    # --- reads ------------------------------------------------------------------------------

    def prefetch(
        self, tokens: Sequence[int], first_page: int, parent_key: str | None
    ) -> Prefetch | None:
        """The prefetch covering `tokens`' page `first_page`, started if none runs and the
        pages from there are worth it (at least `prefetch_threshold` tokens); None when not,
        or when one stopped at that page moments ago."""
        ps = self.spec.page_size
        rest = tokens[first_page * ps :]
        # Asked every step while the request waits: hash one page to find it, not the prompt.
        first = self.namespace.chain(parent_key, rest[:ps])[0]
        running = self.prefetches.get(first)
        if running is not None:
            return running  # whatever is left of it, once joined, is waited for
        if len(rest) < max(self.cfg.prefetch_threshold, ps):
            return None
        with self._lock:
            stopped = self._stopped_at.get(first)
        if stopped is not None and time.monotonic() - stopped < self.cfg.miss_ttl_s:
            return None  # a prefetch just stopped here (missing or damaged): do not ask again
        keys = self.namespace.chain(parent_key, rest)
        pf = Prefetch(tuple(tokens), first_page, keys, time.monotonic() + self._wait_limit(keys))
        self.prefetches.update(dict.fromkeys(keys, pf))
        self._running.append(pf)
        self.stats.add(prefetches=1)
        self._fetchers.submit(self._fetch, pf)
        return pf

    def _wait_limit(self, keys: list[str]) -> float:
        tokens = len(keys) * self.spec.page_size
        if self.cfg.prefetch_policy == "auto":
            return self.rates.wait_limit(tokens, len(keys) * self.spec.bytes_per_page)
        return self.cfg.wait_limit(tokens)

    def _fetch(self, pf: Prefetch) -> None:
        done = 0
        try:
            while done < len(pf.keys) and not pf.cancelled.is_set():
                while pf.fetched.qsize() >= FETCH_AHEAD and not pf.cancelled.is_set():
                    time.sleep(0.005)  # the engine places what came; memory stays bounded
                got = self._fetch_batch(pf.keys[done : done + self.cfg.batch_pages])
                if got:
                    pf.fetched.put((done, got))
                    self._any_fetched.set()
                done += len(got)
                if len(got) < min(self.cfg.batch_pages, len(pf.keys) - done + len(got)):
                    break  # a page is missing: the pages after it cannot be used
            if done < len(pf.keys) and not pf.cancelled.is_set():
                self.stats.add(miss_pages=len(pf.keys) - done)
                with self._lock:
                    self._stopped_at[pf.keys[done]] = time.monotonic()
                    while len(self._stopped_at) > MAX_STOPPED:
                        self._stopped_at.popitem(last=False)
        except Exception:  # a bug here must not leave the request waiting for ever
            logger.exception("storage prefetch failed")
        finally:
            pf.done.set()
            self._any_fetched.set()

    def _fetch_batch(self, keys: list[str]) -> list[bytes]:
        """The payloads of the leading pages of `keys` that exist and are intact."""
        try:
            start = time.perf_counter()
            found = self.store.call(self.backend.exists, keys)
            n = found.index(False) if False in found else len(found)
            if n == 0:
                return []
            blobs = self.store.call(self.backend.get, keys[:n])
            seconds = time.perf_counter() - start
        except StorageUnavailable:
            return []
        self.rates.read.observe(sum(len(b) for b in blobs if b), seconds)
        out = []
        for key, blob in zip(keys[:n], blobs, strict=True):
            payload = unpack(blob, key, self.spec) if blob else None
            if payload is None:
                if blob:  # present but not this page: counted, rewritten when next stored
                    self.stats.add(corrupt_objects=1)
                    self._bad_keys.add(key)
                break
            out.append(payload)
        self.stats.add(read_bytes=sum(len(b) for b in blobs if b), read_seconds=seconds)
        return out

    def should_wait(self, pf: Prefetch, busy: bool) -> bool:
        """Whether the request behind `pf` stays out of the batch for now (the policy)."""
        if pf.finished:
            return False
        return should_wait(self.cfg.prefetch_policy, pf.done.is_set(), busy, pf.deadline)

    def end(self, pf: Prefetch) -> None:
        """The request went ahead: stop fetching what it will compute anyway."""
        pf.cancelled.set()

    def take_fetched(self) -> list[tuple[Prefetch, int, list[bytes]]]:
        """(prefetch, index of its first page in this batch, payloads) fetched since the last
        call. Prefetches that ended and were emptied are forgotten here, so a request never
        joins a finished one."""
        self._any_fetched.clear()
        out, running = [], []
        for pf in self._running:
            while not pf.fetched.empty():
                start, payloads = pf.fetched.get()
                out.append((pf, start, payloads))
            if pf.done.is_set() and pf.fetched.empty():
                for key in pf.keys:
                    if self.prefetches.get(key) is pf:
                        del self.prefetches[key]
            else:
                running.append(pf)
        self._running = running
        return out

    def wait_for_fetches(self, timeout_s: float) -> None:
        """Block the engine thread briefly when only prefetches are left to wait for."""
        self._any_fetched.wait(timeout_s)

    def close(self) -> None:
        for pf in list(self._running):
            pf.cancelled.set()
        with contextlib.suppress(queue.Full):
            self._writes.put_nowait(None)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self.backend.close()  # store calls still running are daemon threads: nothing to join
