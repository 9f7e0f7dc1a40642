"""Runs the synchronous engine loop in its own thread and streams outputs to asyncio tasks.

The event loop only tokenizes (in a worker thread), enqueues and awaits; the engine thread owns
all scheduler state. Each request has its own queue, so a slow client never stalls the others.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from tierserve.engine.engine import Engine
from tierserve.engine.request import Request, RequestOutput
from tierserve.sampling_params import SamplingParams

logger = logging.getLogger("tierserve")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="tierserve-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it advances; aborts it if the consumer goes away."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error}")
        req = await asyncio.to_thread(self.engine.make_request, prompt, params, request_id)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[req.rid] = (asyncio.get_running_loop(), outputs)
        # The loop sets `error` before it fails every registered stream: checked after
        # registering, a request either is failed by the loop or sees the error here.
        if self.error is not None:
            self._streams.pop(req.rid, None)
            raise EngineDeadError(f"engine loop failed: {self.error}")
        self._post("add", req)
        finished = False
        try:
            while not finished:
                # No asyncio.wait_for here: before Python 3.12 it can swallow a cancellation
                # that races with a result, and a client that left kept its request running.
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine loop failed: {out}")
                finished = out.finished
                yield out
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                self._post("abort", req.rid)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread, between steps."""
        future: Future = Future()
        self._post("call", (fn, future))
        if self.error is not None:  # posted after the loop failed: nobody will run it
            self._fail_pending()
        return await asyncio.wrap_future(future)

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as err:  # a bug, not bad input: say so everywhere, then stop
            logger.exception("engine loop failed; the server now answers 503")
            self.error = err
            for rid in list(self._streams):
                self._deliver(rid, err)
            self._fail_pending()

    def _fail_pending(self) -> None:
        """Answer every call still in the inbox with the loop's failure."""
        for kind, payload in self._taken():
            if kind == "call":
                payload[1].set_exception(EngineDeadError(f"engine loop failed: {self.error}"))

    def _taken(self) -> Iterator[tuple[str, Any]]:
        """What the inbox holds now, taken out one by one."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for kind, payload in self._taken():
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self.engine.abort(payload)
            else:
                fn, future = payload
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:
                    future.set_exception(err)
                except BaseException as err:  # the loop dies of it: say so to the caller too
                    future.set_exception(EngineDeadError(f"engine loop failed: {err!r}"))
                    raise

    def _add(self, req: Request) -> None:
        if req.rid not in self._streams:  # the client left before the request started
            return
        try:
            self.engine.submit(req)
        except Exception as err:
            self._deliver(req.rid, err)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(rid)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # that event loop is closed
            self._streams.pop(rid, None)
