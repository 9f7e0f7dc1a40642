"""Copies between tiers, as operations with a life, and the backends that carry them out.

A `CopyOp` is one batch of whole pages, device → host (a backup) or host → device (a load). It is
queued while the engine step decides, issued once per step (one backup batch, one load batch),
and lands some time later. Until it has landed:
- a backup's device pages are not freed (eviction of its nodes is deferred), and its host pages
  are not a valid copy yet;
- a load's host pages are not evicted or reused, and its device pages are not evicted; requests
  that need them run only once the op is `readable`.
Completion is observed at one point: `poll()` at the start of each scheduling step.

Backends differ only in when an op becomes readable and landed:
- `ImmediateTransfer` (CPU): the copy runs when issued; readable and landed at once.
- `StreamTransfer` (CUDA): copies run on a side stream straight between the page-locked host
  pool and the device pool, page runs at a time (no staging buffer, nothing allocated on the
  device). A load is readable when issued, because the compute stream waits on its event; it
  lands when the event completes.
- tests add one that lands ops steps later, in random order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tierserve.cache.pool import PagedKV


@dataclass(eq=False)
class CopyOp:
    kind: Literal["backup", "load"]
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    issued: bool = False
    readable: bool = False  # the destination pages may be read by compute
    landed: bool = False  # done: the source may be freed or reused, the destination evicted
    issued_at: float = 0.0
    seconds: float = 0.0  # issue → landed, as observed
    handle: Any = None  # backend-private (a CUDA event)

    def add(self, src: list[int], dst: list[int]) -> None:
        self.src += src
        self.dst += dst

    @property
    def pages(self) -> int:
        return len(self.src)


def page_runs(src: list[int], dst: list[int]) -> Iterator[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both sides are consecutive page ids."""
    i = 0
    while i < len(src):
        n = 1
        while i + n < len(src) and src[i + n] == src[i] + n and dst[i + n] == dst[i] + n:
            n += 1
        yield src[i], dst[i], n
        i += n


def copy_pages(
    src: PagedKV, src_pages: list[int], dst: PagedKV, dst_pages: list[int], non_blocking: bool
) -> None:
    """One contiguous copy per run of pages, straight from buffer to buffer. Within a device
    all runs go in one call (per-call overhead dominates short runs); across devices each run
    is one async memcpy on the current stream."""
    runs = list(page_runs(src_pages, dst_pages))
    if not runs:
        return
    if src.data.device == dst.data.device:
        # torch._foreach_copy_ itself, by the name torch's stubs export it under.
        torch._VF._foreach_copy_(
            [dst.data[d : d + n] for _, d, n in runs], [src.data[s : s + n] for s, _, n in runs]
        )
        return
    for s, d, n in runs:
        dst.data[d : d + n].copy_(src.data[s : s + n], non_blocking=non_blocking)


class TransferBackend(ABC):
    def __init__(self, device_pool: PagedKV, host_pool: PagedKV) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.in_flight: list[CopyOp] = []
        # Tensor parallelism: another rank writes this host pool (a shared copy), so backups
        # here copy nothing; and landings are agreed among the ranks (`agree`: each in-flight
        # op's local flag in, the flags of all ranks ANDed out), so every rank's scheduler
        # sees a copy land in the same step.
        self.writes_host = True
        self.agree: Callable[[list[bool]], list[bool]] | None = None

    def issue(self, op: CopyOp) -> None:
        op.issued, op.issued_at = True, time.perf_counter()
        self.in_flight.append(op)
        if op.kind == "backup" and not self.writes_host:
            self._skip(op)
            return
        self._start(op)

    def poll(self) -> list[CopyOp]:
        """Ops that landed since the last poll (never blocks)."""
        flags = [self._landed(op) for op in self.in_flight]
        if self.agree is not None and self.in_flight:
            flags = self.agree(flags)
        return self._retire(
            [op for op, landed in zip(self.in_flight, flags, strict=True) if landed]
        )

    def wait_backups(self) -> None:
        """Block until this rank's backups have landed (before other ranks read them)."""
        for op in self.in_flight:
            if op.kind == "backup":
                self._wait(op)

    def wait_all(self) -> list[CopyOp]:
        """Block until every issued op has landed."""
        for op in self.in_flight:
            self._wait(op)
        return self._retire(list(self.in_flight))

    def _retire(self, done: list[CopyOp]) -> list[CopyOp]:
        now = time.perf_counter()
        for op in done:
            op.readable = op.landed = True
            op.seconds = op.seconds or self._seconds(op) or now - op.issued_at
        self.in_flight = [op for op in self.in_flight if not op.landed]
        return done

    def _endpoints(self, op: CopyOp) -> tuple[PagedKV, PagedKV]:
        if op.kind == "backup":
            return self.device_pool, self.host_pool
        return self.host_pool, self.device_pool

    def _seconds(self, op: CopyOp) -> float:
        """The copy's own duration when the backend can measure it; else issue → observed."""
        return 0.0

    def _skip(self, op: CopyOp) -> None:
        """A backup another rank makes: landed when copies issued now land (at once here)."""
        op.readable = op.landed = True

    @abstractmethod
    def _start(self, op: CopyOp) -> None: ...

    @abstractmethod
    def _landed(self, op: CopyOp) -> bool: ...

    @abstractmethod
    def _wait(self, op: CopyOp) -> None: ...


class ImmediateTransfer(TransferBackend):
    """CPU: the copy is done when issued, through the same bookkeeping as an async one."""

    def _start(self, op: CopyOp) -> None:
        src, dst = self._endpoints(op)
        copy_pages(src, op.src, dst, op.dst, non_blocking=False)
        op.readable = op.landed = True
        op.seconds = time.perf_counter() - op.issued_at

    def _landed(self, op: CopyOp) -> bool:
        return True

    def _wait(self, op: CopyOp) -> None:
        pass


class StreamTransfer(TransferBackend):
    """CUDA: a side stream, one event per op; compute waits on loads, never on backups."""

    def __init__(self, device_pool: PagedKV, host_pool: PagedKV) -> None:
        super().__init__(device_pool, host_pool)
        self.stream = torch.cuda.Stream(device_pool.device)

    def _start(self, op: CopyOp) -> None:
        src, dst = self._endpoints(op)
        compute = torch.cuda.current_stream(self.device_pool.device)
        # A backup reads KV the compute stream wrote; a load writes pages it may have read.
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            copy_pages(src, op.src, dst, op.dst, non_blocking=True)
            end.record(self.stream)
        op.handle = (start, end)
        if op.kind == "load":
            compute.wait_event(end)
            op.readable = True

    def _skip(self, op: CopyOp) -> None:
        op.handle = None  # landed here at once; `agree` holds it until the writer's has

    def _landed(self, op: CopyOp) -> bool:
        return op.handle is None or bool(op.handle[1].query())

    def _wait(self, op: CopyOp) -> None:
        if op.handle is not None:
            op.handle[1].synchronize()

    def _seconds(self, op: CopyOp) -> float:
        if op.handle is None:
            return 0.0
        start, end = op.handle
        return start.elapsed_time(end) / 1000


TransferFactory = Callable[[PagedKV, PagedKV], TransferBackend]


def default_transfer(device_pool: PagedKV, host_pool: PagedKV) -> TransferBackend:
    if device_pool.device.type == "cuda":
        return StreamTransfer(device_pool, host_pool)
    return ImmediateTransfer(device_pool, host_pool)
