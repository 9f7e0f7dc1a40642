"""The storage tier (L3) under the host tier: background writes of pages that reach the host,
and prefetches of prefixes that miss on device and host, both off the engine thread.

Writes: a page copied to the host tier is queued for storage (SGLang HiCache's behaviour: what
reaches the host is backed up), packed and checked against the store on a writer thread, and put
in batches. The queue is bounded: when it is full a page is dropped and counted, never waited for.

Reads (prefetch.py): a request whose uncached prefix is at least `prefetch_threshold` tokens
starts a prefetch of its pages, in order, in batches, on worker threads; the engine thread places
what every rank of its group has fetched at its next step, into the host tier, whence the request
loads them back like any host hit. How long the request waits: prefetch_policy.py.

Closing: the queued writes are the engine's to flush first (bounded); then the store's client is
torn down, unless the store does not answer (the breaker is open, or its health check fails):
tearing down a Mooncake client whose master is gone waits out its RPC timeouts, several seconds
a process. Even a store that answers gets at most `close_timeout_s` (2 s) before its client is
left to the process's exit. A client left so is `client_left_open`: the process should end with
`os._exit` once the engine has closed (the engine core and the ranks do), or Mooncake's own exit
handler tears it down against the dead master all the same.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

from tierserve.storage.backend import StorageBackend
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.config import StorageConfig
from tierserve.storage.keys import Namespace
from tierserve.storage.objects import pack
from tierserve.storage.prefetch import Prefetcher, RankRoles
from tierserve.storage.prefetch_policy import PrefetchRates
from tierserve.storage.registry import make_backend

logger = logging.getLogger("tierserve")


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
            cfg, namespace, self.store, self.backend, self.stats, rates, self.roles
        )
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._queued_bytes = 0  # bounded by cfg.write_queue_bytes (see write_room)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-writer")
        self._writer.start()
        self.client_left_open = False  # close() left the store's client without its teardown

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
            taken: list[tuple[str, bytes] | None] = [item]  # None: the stop after the pages
            while len(taken) < self.cfg.batch_pages and not self._writes.empty():
                taken.append(self._writes.get_nowait())  # the only consumer: never empty here
            stop = taken[-1] is None
            batch = [b for b in taken if b is not None]
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
            suspect = self.reads.suspects(keys)
            todo = {
                k: pack(k, self.spec, payload)
                for (k, payload), found in zip(batch, present, strict=True)
                if not found or k in suspect
            }
            if todo:
                start = time.perf_counter()
                dropped = self.store.call(self.backend.put, todo)
                for key in dropped:  # no room in a capped store: not written
                    del todo[key]
                self.reads.written(list(todo))  # stored now: worth asking for again
                self.stats.add(
                    written_pages=len(todo),
                    written_bytes=sum(len(b) for b in todo.values()),
                    write_seconds=time.perf_counter() - start,
                    dropped_writes=len(dropped),
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
        self._close_client()  # store calls still running are daemon threads: nothing to join

    def _close_client(self) -> None:
        if not self.backend.tears_down:
            self.backend.close()
            return
        who = f"storage ({self.cfg.backend}, {self.namespace.shard})"
        reason = self._unreachable()
        if reason is not None:
            self.client_left_open = True
            logger.warning("%s: client teardown skipped, no answer (%s)", who, reason)
            return
        closing = threading.Thread(target=self.backend.close, daemon=True, name="kv-store-close")
        closing.start()
        closing.join(self.cfg.close_timeout_s)
        if closing.is_alive():
            self.client_left_open = True
            logger.warning(
                "%s: client teardown abandoned after close_timeout_s = %s s",
                who,
                self.cfg.close_timeout_s,
            )

    def _unreachable(self) -> str | None:
        """Why the store's client should not be torn down (None: it answers)."""
        if self.store.state == "open":
            return "circuit breaker open"
        try:
            answers = self.store.call(self.backend.answers)
        except StorageUnavailable as err:
            return str(err)
        return None if answers else "health check failed"
