"""Calls into a store's client that cannot hang the server: each runs on a daemon thread of its
own, at most `workers` at once, and is waited for at most `timeout_s`. A call that outlives it is
abandoned and counted (a blocking C++ call cannot be cancelled; its slot stays taken until it
returns, and with every slot taken a call fails at once). A circuit breaker stops calling after
`failures_to_open` consecutive failures and lets one call through after `cooldown_s`: a store
that is down costs hits, not time. Its opening is logged once (with the last failure), and so is
the first call that succeeds after it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from tierserve.storage.backend import StorageBackend

T = TypeVar("T")

logger = logging.getLogger("tierserve")


class StorageUnavailable(Exception):
    """The store did not answer in time, failed, or the breaker is open."""


@dataclass
class StorageStats:
    hit_pages: int = 0  # pages found in storage and delivered to the host tier
    miss_pages: int = 0  # pages looked up and not found (or not fetched: outage, corruption)
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_pages: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0
    prefetches: int = 0
    timeouts: int = 0
    errors: int = 0
    corrupt_objects: int = 0
    dropped_writes: int = 0  # pages not written: queue full, store unavailable or out of room
    # Fetched but not placed: no host room, no prefix left to attach to, or already cached.
    dropped_prefetch_pages: int = 0
    breaker_opens: int = 0
    breaker_skips: int = 0  # calls not made while the breaker was open

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **counts: float) -> None:
        """Counters change from worker threads and the engine thread alike."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GuardedStore:
    def __init__(
        self,
        backend: StorageBackend,
        stats: StorageStats,
        timeout_s: float = 2.0,
        workers: int = 4,
        failures_to_open: int = 3,
        cooldown_s: float = 5.0,
    ) -> None:
        self.backend, self.stats = backend, stats
        self.timeout_s, self.failures_to_open, self.cooldown_s = (
            timeout_s,
            failures_to_open,
            cooldown_s,
        )
        self._slots = threading.Semaphore(workers)  # calls not returned, abandoned ones too
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0
        self._said_open = False  # the opening was logged; the next success says it closed

    @property
    def state(self) -> str:
        """closed (calls go through), open (none do), half-open (the next one tests)."""
        with self._lock:
            if self._failures < self.failures_to_open:
                return "closed"
            return "open" if time.monotonic() < self._open_until else "half-open"

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if time.monotonic() < self._open_until:
                self.stats.add(breaker_skips=1)
                raise StorageUnavailable("the store is not answering (circuit breaker open)")
        if not self._slots.acquire(blocking=False):
            reason = "every storage worker is stuck in an earlier call"
            self._failed(reason, errors=1)
            raise StorageUnavailable(reason)
        future: Future[T] = Future()
        # A daemon thread per call: one stuck in the store's C++ client must not keep the
        # process from exiting (a pool's workers are joined at exit).
        worker = threading.Thread(target=self._run, args=(future, fn, args), daemon=True)
        worker.start()
        try:
            result = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            reason = f"no answer within {self.timeout_s} s"
            self._failed(reason, timeouts=1)
            raise StorageUnavailable(reason) from None
        except Exception as err:  # any failure of a third-party client: counted, not raised on
            reason = f"{type(err).__name__}: {err}"
            self._failed(reason, errors=1)
            raise StorageUnavailable(reason) from None
        with self._lock:
            self._failures = 0
            said, self._said_open = self._said_open, False
        if said:
            logger.warning("storage (%s) answers again: circuit breaker closed", self.backend.name)
        return result

    def _run(self, future: Future[T], fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # handed to the waiting caller
            future.set_exception(err)
        finally:
            self._slots.release()

    def _failed(self, reason: str, **counts: int) -> None:
        self.stats.add(**counts)
        with self._lock:
            self._failures += 1
            if self._failures < self.failures_to_open:
                return
            if time.monotonic() >= self._open_until:
                self.stats.add(breaker_opens=1)
            self._open_until = time.monotonic() + self.cooldown_s
            say, self._said_open = not self._said_open, True
            failures = self._failures
        if say:
            logger.warning(
                "storage (%s): circuit breaker open after %d failed calls, the last: %s; "
                "one call tries again every %s s",
                self.backend.name,
                failures,
                reason,
                self.cooldown_s,
            )
