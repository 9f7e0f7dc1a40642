"""Prefetches: the pages of a request's stored prefix, fetched in order on worker threads and
handed to the engine thread at its next step (`take`), in amounts every rank of a tensor-parallel
group agrees on.

Under tensor parallelism every rank's scheduler makes the same decisions from the same inputs
(distributed/bus.py), but what a fetcher has brought by now, and whether a wait has run out,
are timings that differ between ranks. So at each step, while prefetches run, the ranks take the
MIN over the group (one small all-reduce) of: the pages each rank has fetched of each prefetch,
whether its fetch has ended, and, from the group's first rank alone, whether the policy's wait
has run out and how many of the remembered stops have expired. Every rank then places exactly
the agreed pages into its host tier, so trees and schedulers never diverge. A rank whose host
copy another rank of its node fills (cache/shared_host.py: MLA latents, replicated heads)
fetches nothing: it places the same host pages without their bytes, which the filling rank
writes into the shared copy, so a replicated page is read once per node.

A damaged page (its header or checksum does not match) ends its prefetch, and the pages after it
were never checked: the request recomputes them all, and the writer rewrites every one of them
rather than trust the store's `exists`, so the next pass finds the whole chain intact (not one
page more each pass).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierserve.sizing import KVSpec
from tierserve.storage.backend import StorageBackend
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.config import FETCH_AHEAD, FETCHERS, StorageConfig
from tierserve.storage.keys import Namespace
from tierserve.storage.objects import unpack
from tierserve.storage.prefetch_policy import PrefetchRates, should_wait

logger = logging.getLogger("tierserve")

MAX_STOPPED = 1024  # pages where prefetches stopped, remembered for miss_ttl_s
MAX_SUSPECT = 1 << 16  # keys to rewrite without asking `exists`: a few long chains
NEVER = 2**62  # what a rank contributes to a MIN it has no say in


@dataclass(frozen=True)
class RankRoles:
    """This rank's part in its group's storage tier (a lone rank plays every part)."""

    all_min: Callable[[list[int]], list[int]] | None = None  # MIN over the group; None: alone
    leads: bool = True  # its clock decides the group's waits and expiries
    fetches: bool = True  # it reads the store (not a rank whose host copy another one fills)
    writes: bool = True  # it writes pages (one rank of those holding the same bytes)

    @classmethod
    def of(
        cls,
        spec: KVSpec,
        rank: int,
        attention_tp: int,
        local_ranks: int,
        sharing: int,
        all_min: Callable[[list[int]], list[int]],
    ) -> RankRoles:
        """Under TP: the attention group's first rank leads; one rank of those holding the same
        bytes (an MLA latent: all; a replicated head: its neighbours) writes them; the rank that
        fills a shared host copy (`sharing` ranks map it) reads for all of them."""
        attention_rank = rank % attention_tp
        fills = sharing == 1 or spec.share_group(rank, local_ranks)[1] == rank
        writes = attention_rank % spec.copies == 0
        return cls(all_min, leads=attention_rank == 0, fetches=fills, writes=writes)


@dataclass(eq=False)
class Prefetch:
    """Pages `first_page ...` of `tokens`, fetched in order by a worker."""

    tokens: tuple[int, ...]  # whole pages, through the last one it may fetch
    first_page: int  # pages the tree held when it started
    keys: list[str]
    deadline: float  # the group's first rank's clock: when the policy's wait runs out
    expired: bool = False  # agreed: the wait has run out
    fetched: list[bytes | None] = field(default_factory=list)  # appended by the worker
    taken: int = 0  # pages handed to the engine (their payloads dropped here)
    ended: bool = False  # agreed: every rank's fetch ended and all it brought was taken
    done: threading.Event = field(default_factory=threading.Event)  # this rank's fetch ended
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.ended


class Prefetcher:
    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        store: GuardedStore,
        backend: StorageBackend,
        stats: StorageStats,
        rates: PrefetchRates,
        roles: RankRoles,
    ) -> None:
        self.cfg, self.policy = cfg, cfg.prefetch_policy
        self.namespace, self.spec = namespace, namespace.spec
        self.store, self.backend, self.stats, self.rates = store, backend, stats, rates
        self.roles = roles
        self.threshold, self.batch_pages = cfg.prefetch_threshold, cfg.batch_pages
        # Prefetches not ended, by every key they cover: a request whose missing part starts
        # anywhere in one joins it instead of fetching the same pages again.
        self.by_key: dict[str, Prefetch] = {}
        self._running: list[Prefetch] = []
        # Found damaged, or after a damaged page in its chain: rewritten without asking
        # `exists`, oldest forgotten first.
        self._suspect: OrderedDict[str, None] = OrderedDict()
        # Where prefetches stopped (a page missing or damaged), in the order the group agreed
        # on them, so a request that goes ahead after a partial prefetch does not start
        # another one at the same page for miss_ttl_s.
        self.stops: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(FETCHERS, thread_name_prefix="tierserve-prefetch")
        self._any_fetched = threading.Event()

    # --- the engine thread ----------------------------------------------------------------

    def start(
        self, tokens: Sequence[int], first_page: int, parent_key: str | None
    ) -> Prefetch | None:
        """The prefetch covering `tokens`' page `first_page`, started if none runs and the
        pages from there are worth it (at least `threshold` tokens); None when not, or when one
        stopped at that page moments ago. Every rank of a group calls it at the same point."""
        ps = self.spec.page_size
        rest = tokens[first_page * ps :]
        # Asked every step while the request waits: hash one page to find it, not the prompt.
        first = self.namespace.chain(parent_key, rest[:ps])[0]
        running = self.by_key.get(first)
        if running is not None:
            return running  # whatever is left of it, once joined, is waited for
        if len(rest) < max(self.threshold, ps) or first in self.stops:
            return None
        keys = self.namespace.chain(parent_key, rest)
        limit = self._wait_limit(keys)
        pf = Prefetch(tuple(tokens), first_page, keys, time.monotonic() + limit, limit <= 0)
        self.by_key.update(dict.fromkeys(keys, pf))
        self._running.append(pf)
        self.stats.add(prefetches=1)
        if self.roles.fetches:
            self._threads.submit(self._fetch, pf)
        else:
            pf.done.set()  # another rank fills this rank's host copy
        return pf

    def _wait_limit(self, keys: list[str]) -> float:
        tokens = len(keys) * self.spec.page_size
        if self.policy != "auto":
            return self.cfg.wait_limit(tokens)
        limit = self.rates.wait_limit(tokens, len(keys) * self.spec.bytes_per_page)
        if self.roles.all_min is None:
            return limit
        # Measured rates differ between ranks: the group's first rank decides for all.
        micros = int(limit * 1e6) if self.roles.leads else NEVER
        return self.roles.all_min([micros])[0] / 1e6

    def should_wait(self, pf: Prefetch, busy: bool) -> bool:
        """Whether the request behind `pf` stays out of the batch for now (the policy)."""
        return not pf.ended and should_wait(self.policy, busy, pf.expired)

    def take(self) -> list[tuple[Prefetch, int, list[bytes | None]]]:
        """(prefetch, index of its first page in this batch, payloads: None where another rank
        writes the bytes) agreed since the last call. Ended prefetches are forgotten here, so a
        request never joins one."""
        self._any_fetched.clear()
        running = self._running
        if not running and not self.stops:
            return []
        done = [int(pf.done.is_set()) for pf in running]  # before the counts: all are in
        ready = [len(pf.fetched) if self.roles.fetches else NEVER for pf in running]
        now = time.monotonic()
        if self.roles.leads:
            expired = [int(pf.expired or now >= pf.deadline) for pf in running]
            with self._lock:
                stale = [sum(now - at >= self.cfg.miss_ttl_s for at in self.stops.values())]
        else:
            expired, stale = [NEVER] * len(running), [NEVER]
        agreed = ready + done + expired + stale
        if self.roles.all_min is not None:
            agreed = self.roles.all_min(agreed)
        n = len(running)
        with self._lock:
            for _ in range(min(agreed[-1], len(self.stops))):
                self.stops.popitem(last=False)  # oldest first: expired in the order agreed
        out, still = [], []
        for i, pf in enumerate(running):
            have = min(agreed[i], len(pf.keys))
            if have > pf.taken:
                out.append((pf, pf.taken, self._hand_over(pf, have)))
            pf.expired = bool(agreed[2 * n + i])
            if agreed[n + i]:  # every rank's fetch ended: what was agreed is all there is
                self._end(pf, now)
            else:
                still.append(pf)
        self._running = still
        return out

    def _hand_over(self, pf: Prefetch, have: int) -> list[bytes | None]:
        if not self.roles.fetches:
            payloads: list[bytes | None] = [None] * (have - pf.taken)
        else:
            payloads = pf.fetched[pf.taken : have]
            pf.fetched[pf.taken : have] = [None] * (have - pf.taken)  # the host holds them now
        pf.taken = have
        return payloads

    def _end(self, pf: Prefetch, now: float) -> None:
        pf.ended = True
        for key in pf.keys:
            if self.by_key.get(key) is pf:
                del self.by_key[key]
        if pf.taken < len(pf.keys) and not pf.cancelled.is_set():
            with self._lock:
                self.stops[pf.keys[pf.taken]] = now
                while len(self.stops) > MAX_STOPPED:
                    self.stops.popitem(last=False)

    def end(self, pf: Prefetch) -> None:
        """The request went ahead: stop fetching what it will compute anyway."""
        pf.cancelled.set()

    def written(self, keys: list[str]) -> None:
        """Pages this server just stored: intact now, and worth asking for again. Alone only:
        a group forgets its stops at agreed points, never at a writer thread's moment."""
        with self._lock:
            for key in keys:
                self._suspect.pop(key, None)
                if self.roles.all_min is None:
                    self.stops.pop(key, None)

    def suspects(self, keys: list[str]) -> set[str]:
        """Those of `keys` the writer must store whatever `exists` says."""
        with self._lock:
            return {k for k in keys if k in self._suspect}

    def _distrust(self, keys: list[str]) -> None:
        with self._lock:
            self._suspect.update(dict.fromkeys(keys))
            while len(self._suspect) > MAX_SUSPECT:
                self._suspect.popitem(last=False)

    def wait(self, timeout_s: float) -> None:
        """Block the engine thread briefly when only prefetches are left to wait for."""
        self._any_fetched.wait(timeout_s)

    def close(self) -> None:
        for pf in list(self._running):
            pf.cancelled.set()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # --- the fetcher threads --------------------------------------------------------------

    def _fetch(self, pf: Prefetch) -> None:
        try:
            while len(pf.fetched) < len(pf.keys) and not pf.cancelled.is_set():
                while (
                    len(pf.fetched) - pf.taken >= FETCH_AHEAD * self.batch_pages
                    and not pf.cancelled.is_set()
                ):
                    time.sleep(0.005)  # the engine places what came; memory stays bounded
                start = len(pf.fetched)
                want = pf.keys[start : start + self.batch_pages]
                got, damaged = self._fetch_batch(want)
                if damaged:  # before the engine can place the pages and recompute the rest
                    self._distrust(pf.keys[start + len(got) :])
                pf.fetched.extend(got)
                self._any_fetched.set()
                if len(got) < len(want):
                    break  # a page is missing or damaged: the pages after it cannot be used
            if len(pf.fetched) < len(pf.keys) and not pf.cancelled.is_set():
                self.stats.add(miss_pages=len(pf.keys) - len(pf.fetched))
        except Exception:  # a bug here must not leave the request waiting for ever
            logger.exception("storage prefetch failed")
        finally:
            pf.done.set()
            self._any_fetched.set()

    def _fetch_batch(self, keys: list[str]) -> tuple[list[bytes | None], bool]:
        """The payloads of the leading pages of `keys` that exist and are intact, and whether
        a damaged page ended them."""
        try:
            start = time.perf_counter()
            found = self.store.call(self.backend.exists, keys)
            n = found.index(False) if False in found else len(found)
            if n == 0:
                return [], False
            blobs = self.store.call(self.backend.get, keys[:n])
            seconds = time.perf_counter() - start
        except StorageUnavailable:
            return [], False
        self.rates.read.observe(sum(len(b) for b in blobs if b), seconds)
        out: list[bytes | None] = []
        damaged = False
        for key, blob in zip(keys[:n], blobs, strict=True):
            payload = unpack(blob, key, self.spec) if blob else None
            if payload is None:
                damaged = bool(blob)  # present but not this page (else: gone since `exists`)
                if damaged:
                    self.stats.add(corrupt_objects=1)
                break
            out.append(payload)
        self.stats.add(read_bytes=sum(len(b) for b in blobs if b), read_seconds=seconds)
        return out, damaged
