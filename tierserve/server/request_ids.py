"""Client request ids held while an aborted request with the id may still be in the engine
core: a retry with the same `rid` waits until the core has applied the abort, or the old
request's last tokens, which the core sent before it read the abort, would be routed by id
to the retry (clients retry with their own rid).

The core counts the aborts it has applied in every StepOutputs (`aborts_taken`); an id is held
until that count covers its latest abort: the batch of steps the core is in, at most
(`--num-continuous-decode-steps` of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Future]


@dataclass
class _Held:
    abort: int = 0  # the abort the core must have applied: its place in the count
    waiters: list[Waiter] = field(default_factory=list)


class HeldIds:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the event loop and the core's reader thread
        # Aborts are counted and sent under this one, so the count follows the order in which
        # the core reads them; a send that blocks (a stopped core) holds it alone, never
        # `_lock`, which the watchdog's failure path takes to wake the waiters.
        self._sending = threading.Lock()
        self._aborts_sent = 0
        self._held: dict[str, _Held] = {}
        self._closed = False  # the core is gone: nothing is held any more

    def abort(self, rid: str, send: Callable[[], None]) -> None:
        """Hold `rid` and `send()` its abort."""
        with self._sending:
            with self._lock:
                if not self._closed:
                    self._aborts_sent += 1
                    self._held.setdefault(rid, _Held()).abort = self._aborts_sent
            send()

    async def released(self, rid: str, check_alive: Callable[[], None]) -> None:
        """Return once no aborted request holds `rid` (at once, nearly always)."""
        loop = asyncio.get_running_loop()
        while True:
            check_alive()  # after the core died, no abort is applied: nothing to wait for
            with self._lock:
                held = self._held.get(rid)
                if held is None:
                    return
                waiter = (loop, loop.create_future())
                held.waiters.append(waiter)
            try:
                await waiter[1]
            finally:
                with self._lock:
                    if waiter in held.waiters:
                        held.waiters.remove(waiter)

    def applied(self, aborts_taken: int) -> None:
        """On the reader: the core reports this many aborts applied."""
        with self._lock:
            freed = [r for r, h in self._held.items() if h.abort <= aborts_taken]
            waiters = [w for rid in freed for w in self._held.pop(rid).waiters]
        _wake(waiters)

    def release_all(self) -> None:
        """The core is gone: every waiter wakes (and sees why)."""
        with self._lock:
            self._closed = True
            waiters = [w for h in self._held.values() for w in h.waiters]
            self._held.clear()
        _wake(waiters)

    def waiting(self) -> int:
        """Requests waiting for an id."""
        with self._lock:
            return sum(len(h.waiters) for h in self._held.values())


def _wake(waiters: list[Waiter]) -> None:
    for loop, released in waiters:
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(_set_once, released)


def _set_once(released: asyncio.Future) -> None:
    if not released.done():  # its waiter may have been cancelled (the client left)
        released.set_result(None)
