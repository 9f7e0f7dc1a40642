"""Runs the synchronous engine loop in its own thread and streams outputs to asyncio tasks.

The engine thread owns all scheduler state and speaks token ids only: after each step it hands
the step's StepOutputs to each event loop in one call. Detokenization and stop strings run on
the event loop (`OutputBuilder`), tokenization in a worker thread, grammar compiles in the
compile pool's processes. What reaches the engine is its typed messages (messages.py), so the
engine can move to a process of its own by changing only this transport. Each request has its
own queue, so a slow client never stalls the others. Why a thread today: docs/server.md.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tierserve.engine import Engine, OutputBuilder
from tierserve.errors import TierserveError
from tierserve.messages import AbortRequest, AddRequest, EngineInput, FlushCache
from tierserve.outputs import RequestOutput, StepOutput
from tierserve.sampling_params import SamplingParams
from tierserve.server.grammar_pool import DEFAULT_COMPILE_TIMEOUT_S, GrammarCompilePool
from tierserve.server.watchdog import StepGate, StepWatchdog

logger = logging.getLogger("tierserve")


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Call:
    """A function to run on the engine thread: in-process only, beside the engine's messages."""

    fn: Callable[[Engine], Any]


class EngineHungError(EngineDeadError):
    """A step outlived --watchdog-timeout: the engine thread is stuck inside it."""


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_failure: Callable[[], None] | None = None,
        watchdog_timeout_s: float | None = None,
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        """`on_failure` runs once the loop has died (on the engine thread) or hung (on the
        watchdog's) and every waiting call has its 503: the server uses it to shut down and
        exit non-zero."""
        self.engine = engine
        self.on_failure = on_failure
        self._gate = StepGate()
        self.grammar_pool = GrammarCompilePool(engine.grammars, grammar_compile_timeout_s)
        self._watchdog = (
            StepWatchdog(watchdog_timeout_s, self._hung) if watchdog_timeout_s else None
        )
        self._inbox: queue.SimpleQueue[tuple[EngineInput | Call, Future | None]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._run, name="tierserve-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()
        if self._watchdog is not None:
            self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.grammar_pool.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        if isinstance(self.error, EngineHungError):
            return  # the engine thread is stuck in a step: nothing can close it in order
        self._thread.join(timeout=30)
        self.engine.close()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it advances; aborts it if the consumer goes away."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error}")
        arrival = self.engine.next_arrival()  # before tokenizing: its place is when it came
        grammar = None
        if params.structured_output is not None:  # in the pool's processes: a cancel ends it
            grammar = await self.grammar_pool.compile(params.structured_output)
        prepare = self.engine.prepare
        req = await asyncio.to_thread(prepare, prompt, params, request_id, arrival, grammar)
        outputs: asyncio.Queue = asyncio.Queue()
        builder = OutputBuilder(req, self.engine.tokenizer)
        self._streams[req.rid] = Stream(asyncio.get_running_loop(), outputs, builder)
        # The loop sets `error` before it fails every registered stream: checked after
        # registering, a request either is failed by the loop or sees the error here.
        if self.error is not None:
            self._streams.pop(req.rid, None)
            raise EngineDeadError(f"engine loop failed: {self.error}")
        self._post(req)
        finished = False
        try:
            while not finished:
                # No asyncio.wait_for here: before Python 3.12 it can swallow a cancellation
                # that races with a result, and a client that left kept its request running.
                out = await outputs.get()
                if isinstance(out, TierserveError):
                    raise out
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine loop failed: {out}")
                finished = out.finished
                yield out
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                self._post(AbortRequest(req.rid))

    async def flush_cache(self) -> dict[str, int | str]:
        """Pages dropped per tier, once the engine has taken the flush between steps."""
        return await self._ask(FlushCache())

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread, between steps (in-process tools and tests;
        the routes send messages)."""
        return await self._ask(Call(fn))

    async def _ask(self, message: EngineInput | Call) -> Any:
        future: Future = Future()
        self._post(message, future)
        if self.error is not None:  # posted after the loop failed: nobody will run it
            self._fail_pending()
        return await asyncio.wrap_future(future)

    def _post(self, message: EngineInput | Call, reply: Future | None = None) -> None:
        self._inbox.put((message, reply))
        self._wake.set()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.error is None:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                if not self._gate.allows(self.engine.scheduler.stats.num_steps):  # a test holds it
                    self._wake.wait(timeout=0.01)
                    self._wake.clear()
                    continue
                self._hand_over(self._timed_step())
        except BaseException as err:  # a bug, not bad input: say so everywhere, then stop
            logger.exception("engine loop failed; the server now answers 503")
            self._fail(err)

    def _timed_step(self) -> list[StepOutput]:
        if self._watchdog is None:
            return self.engine.step()
        self._watchdog.step_started()
        try:
            return self.engine.step()
        finally:
            self._watchdog.step_ended()

    def _hung(self, timeout_s: float) -> None:
        """On the watchdog's thread: the engine thread is stuck in a step. Tensor-parallel
        ranks are ended, so the server goes the way a dead rank takes it."""
        self._fail(EngineHungError(f"no engine step completed in {timeout_s:g} s"))
        ranks = self.engine.ranks
        for worker in ranks.workers if ranks is not None else ():
            worker.kill()

    def _fail(self, err: BaseException) -> None:
        """Say so everywhere, once: every stream and waiting call gets its 503."""
        if self.error is not None:
            return
        self.error = err
        for rid in list(self._streams):
            self._deliver(rid, err)
        self._fail_pending()
        if self.on_failure is not None:
            self.on_failure()

    def _fail_pending(self) -> None:
        """Answer every question still in the inbox with the loop's failure."""
        for _, reply in self._taken():
            if reply is not None:
                reply.set_exception(EngineDeadError(f"engine loop failed: {self.error}"))

    def _taken(self) -> Iterator[tuple[EngineInput | Call, Future | None]]:
        """What the inbox holds now, taken out one by one."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for message, reply in self._taken():
            if isinstance(message, AddRequest):
                self._add(message)
                continue
            try:
                result = (
                    message.fn(self.engine)
                    if isinstance(message, Call)
                    else self.engine.handle(message)
                )
            except Exception as err:
                if reply is None:
                    raise
                reply.set_exception(err)
            except BaseException as err:  # the loop dies of it: say so to the caller too
                if reply is not None:
                    reply.set_exception(EngineDeadError(f"engine loop failed: {err!r}"))
                raise
            else:
                if reply is not None:
                    reply.set_result(result)

    def _add(self, message: AddRequest) -> None:
        if message.rid not in self._streams:  # the client left before the request started
            return
        try:
            self.engine.handle(message)
        except Exception as err:
            self._deliver(message.rid, err)

    def _hand_over(self, steps: list[StepOutput]) -> None:
        """One call per event loop per step, not one per request: a step of 64 requests wakes
        the loop once."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, StepOutput]]] = {}
        for step in steps:
            stream = self._streams.get(step.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, step))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._build_outputs, items)
            except RuntimeError:  # that event loop is closed: nobody reads these any more
                for stream, _ in items:
                    self._streams.pop(stream.builder.request_id, None)
                    self.engine.abort(stream.builder.request_id)

    def _build_outputs(self, items: list[tuple[Stream, StepOutput]]) -> None:
        """On the event loop: token ids to text, stop strings, and the abort they cause."""
        for stream, step in items:
            try:
                out = stream.builder.add(step)
            except Exception as err:  # a detokenizer failure ends this request, not the loop
                logger.exception("building the output of %s failed", step.request_id)
                self._post(AbortRequest(step.request_id))
                stream.outputs.put_nowait(err)
                continue
            if out is None:
                continue
            if stream.builder.stopped_here:
                self._post(AbortRequest(step.request_id))
            stream.outputs.put_nowait(out)

    def _deliver(self, rid: str, item: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # that event loop is closed
            self._streams.pop(rid, None)
            self.engine.abort(rid)


@dataclass(frozen=True)
class Stream:
    """Where one request's outputs go: its event loop, its queue, and its text state."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    builder: OutputBuilder
