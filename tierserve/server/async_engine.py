"""The API process's view of the engine: requests in, streams of outputs out, over the engine
core's messages (engine/core.py runs the engine in a process of its own).

Here, in the API process: tokenization and validation (`RequestPreparer`, in worker threads),
grammar compiles (the compile pool's processes), detokenization and stop strings
(`OutputBuilder`, on the event loop). The core speaks token ids only; a reader thread takes each
step's outputs off its socket and hands them to each event loop in one call. Each request has
its own queue, so a slow client never stalls the others. Why a process: docs/server.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tierserve.args import EngineArgs
from tierserve.core_messages import (
    AbortRequest,
    Answer,
    Ask,
    CoreFailed,
    CoreInput,
    FlushCache,
    GetMetrics,
    MetricFamily,
    PrepareGrammars,
    RequestFailed,
    StepOutputs,
)
from tierserve.distributed import pin
from tierserve.errors import TierserveError
from tierserve.frontend import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarCompilePool,
    OutputBuilder,
    RequestPreparer,
    WorkerSetup,
)
from tierserve.outputs import RequestOutput, StepOutput
from tierserve.sampling_params import SamplingParams
from tierserve.server.core_client import CoreClient
from tierserve.server.pending_outputs import PendingOutputs
from tierserve.server.request_ids import HeldIds
from tierserve.server.watchdog import StepWatchdog

logger = logging.getLogger("tierserve")


# The most a route that reports the core's state (/metrics, /get_load) waits for it: a core
# that is stopped or deep in a long step is answered for with its last values, marked stale.
STATE_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    pass


def _dead(err: BaseException) -> EngineDeadError:
    """What a request or a question gets once the core has failed with `err`: a 503 whose
    message is one sentence for a client (the details, which may hold paths and peers'
    addresses, went to the log)."""
    return err if isinstance(err, EngineDeadError) else EngineDeadError(f"the engine failed: {err}")


class EngineHungError(EngineDeadError):
    """A step outlived --watchdog-timeout: the core was stuck inside it, and is killed."""


class AsyncEngine:
    def __init__(
        self,
        core: CoreClient,
        tokenizer: Any,
        tokenizer_dir: str,
        on_failure: Callable[[], None] | None = None,
        watchdog_timeout_s: float | None = None,
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        stream_interval: int = 1,
    ) -> None:
        """`on_failure` runs once the core has died (on the reader thread) or hung (on the
        watchdog's) and every waiting call has its 503: the server uses it to shut down and
        exit non-zero. `tokenizer` is the one read from `tokenizer_dir`, where grammar compile
        workers read it too."""
        self.core = core
        self.info = core.info
        self.args: EngineArgs | None = None  # what it was launched with (launch sets it)
        self.tokenizer = tokenizer
        self.preparer = RequestPreparer(core.info, lambda: tokenizer)
        self.on_failure = on_failure
        self.stream_interval = stream_interval  # --stream-interval: tokens a chunk
        grammars = self.preparer.grammars
        setup = WorkerSetup(tokenizer_dir, grammars.vocab_size, grammars.stop_ids)
        self.grammar_pool = GrammarCompilePool(
            setup, grammar_compile_timeout_s, first_compile=self._prepare_grammars
        )
        self._watchdog = (
            StepWatchdog(watchdog_timeout_s, self._stalled_for, self._hung)
            if watchdog_timeout_s
            else None
        )
        # Since when a message has waited for the core to say anything (None: nothing waits).
        self._waiting_since: float | None = None
        self._streams: dict[str, Stream] = {}
        self._asks: dict[int, Future] = {}
        self._ask_ids = itertools.count()
        self._lock = threading.Lock()  # the asks and the failure, between the loop and reader
        # Admission: the queue as the core last saw it, plus adds it has not read yet.
        self._adds_sent = 0
        self._seen = StepOutputs([], 0, 0)
        self._held_ids = HeldIds()  # ids of aborted requests the core may still run
        # The core's last metrics, when they came, and the one question for fresh ones in flight.
        self._last_metrics: list[MetricFamily] = []
        self._last_metrics_at: float | None = None
        self._metrics_ask: asyncio.Future | None = None
        self._reader = threading.Thread(target=self._read, name="tierserve-core-io", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None

    @classmethod
    def launch(
        cls,
        args: EngineArgs,
        log_level: str = "info",
        core: CoreClient | None = None,
        **kwargs: Any,
    ) -> AsyncEngine:
        """The engine core for `args` (started here unless the caller spawned it) once it is
        ready, with the tokenizer it names; raises TierserveError (exit 2) before anything
        listens if the start-up is refused. The tokenizer loads while the core starts."""
        core = core or CoreClient.spawn(args, log_level)
        try:
            tokenizer = core.tokenizer_beside(args.tokenizer_dir)
        except BaseException:
            core.kill()
            raise
        # The cores the engine core left this process, its grammar workers and tokenization.
        pin(core.info.api_cores)
        engine = cls(core, tokenizer, args.tokenizer_dir, **kwargs)
        engine.args = args
        return engine

    def _prepare_grammars(self) -> None:
        """The core imports xgrammar while the first grammar compiles, not in the step that
        adds its request."""
        self._send(PrepareGrammars())

    @property
    def pid(self) -> int:
        """The engine core's process."""
        return self.core.pid

    def start(self) -> None:
        self._reader.start()
        if self._watchdog is not None:
            self._watchdog.start()

    def stop(self) -> None:
        """Stop the core (it closes the engine first) and the compile pool; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self.grammar_pool.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.error is None:
            code = self.core.stop()
            if code != 0:
                logger.error("the engine core exited with status %s while stopping", code)
        else:
            self.core.kill()

    def waiting(self) -> int:
        """Requests waiting for admission: the core's queue after its last report, and those
        sent since that it has not read."""
        seen = self._seen
        return seen.waiting + self._adds_sent - seen.adds_taken

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it advances; aborts it if the consumer goes away."""
        self._check_alive()
        arrival = self.preparer.next_arrival()  # before tokenizing: its place is when it came
        grammar = None
        if params.structured_output is not None:  # in the pool's processes: a cancel ends it
            grammar = await self.grammar_pool.compile(params.structured_output)
        prepare = self.preparer.prepare
        req = await asyncio.to_thread(prepare, prompt, params, request_id, arrival, grammar)
        await self._held_ids.released(req.rid, self._check_alive)
        if req.rid in self._streams:
            raise TierserveError(f"request id {req.rid!r} is already in flight", "request_id")
        outputs = PendingOutputs(self.stream_interval)
        builder = OutputBuilder(req, self.tokenizer, frozenset(self.info.eos_token_ids))
        self._streams[req.rid] = Stream(asyncio.get_running_loop(), outputs, builder)
        # The reader sets `error` before it fails every registered stream: checked after
        # registering, a request either is failed by the reader or sees the error here.
        if self.error is not None:
            self._streams.pop(req.rid, None)
            self._check_alive()
        self._adds_sent += 1
        try:
            self._send(req)
        except BaseException:  # not sent (a message that does not encode): nothing in flight
            self._adds_sent -= 1
            self._streams.pop(req.rid, None)
            raise
        finished = False
        try:
            while not finished:
                # No asyncio.wait_for here: before Python 3.12 it can swallow a cancellation
                # that races with a result, and a client that left kept its request running.
                out = await outputs.get()
                if isinstance(out, TierserveError):
                    raise out
                if isinstance(out, BaseException):
                    raise _dead(out)
                finished = out.finished
                yield out
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                self._abort(req.rid)

    def waiting_for_ids(self) -> int:
        """Requests waiting until the core has dropped an aborted request with their id."""
        return self._held_ids.waiting()

    def _abort(self, rid: str) -> None:
        self._held_ids.abort(rid, lambda: self._send(AbortRequest(rid)))

    async def flush_cache(self) -> dict[str, int | str]:
        """Pages dropped per tier, once the core has taken the flush between steps."""
        answer = await self._ask(FlushCache())
        assert answer.tiers is not None
        return answer.tiers

    async def metrics(self) -> list[MetricFamily]:
        """The engine's Prometheus families, read by the core between steps."""
        answer = await self._ask(GetMetrics())
        assert answer.metrics is not None
        return answer.metrics

    async def recent_metrics(self) -> tuple[list[MetricFamily], float | None]:
        """The engine's families within STATE_WAIT_S, and how old they are: 0 when the core
        answered in time, else its last answer's age (None: it never answered). One question
        is in flight at a time, however many scrapers wait on it."""
        ask = self._metrics_ask
        if ask is None or ask.done():
            ask = self._metrics_ask = asyncio.ensure_future(self.metrics())
            ask.add_done_callback(self._kept_metrics)
        try:
            families = await asyncio.wait_for(asyncio.shield(ask), STATE_WAIT_S)
        except (TimeoutError, asyncio.TimeoutError):
            self._check_alive()
            at = self._last_metrics_at
            return self._last_metrics, None if at is None else time.monotonic() - at
        return families, 0.0

    def _kept_metrics(self, ask: asyncio.Future) -> None:
        if ask.cancelled() or ask.exception() is not None:  # a dead core: the routes say so
            return
        self._last_metrics, self._last_metrics_at = ask.result(), time.monotonic()

    async def _ask(self, query: FlushCache | GetMetrics) -> Answer:
        future: Future = Future()
        with self._lock:
            self._check_alive()
            ask_id = next(self._ask_ids)
            self._asks[ask_id] = future
        self._send(Ask(ask_id, query))
        return await asyncio.wrap_future(future)

    def _send(self, message: CoreInput) -> None:
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        self.core.send(message)

    def _stalled_for(self) -> float:
        """How long the core has kept the server waiting: in its current step, or (a core that
        is stopped or stuck outside a step) since a message went unanswered. The core answers
        every message it takes with a report soon after."""
        since = self._waiting_since
        waited = time.monotonic() - since if since is not None else 0.0
        return max(self.core.clock.running_for(), waited)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise _dead(self.error)

    # --- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        for message in self.core.messages():
            self._waiting_since = None
            if isinstance(message, StepOutputs):
                self._seen = message
                self._hand_over(message.outputs)
                self._held_ids.applied(message.aborts_taken)
            elif isinstance(message, Answer):
                with self._lock:
                    future = self._asks.pop(message.ask_id, None)
                if future is not None:
                    future.set_result(message)
            elif isinstance(message, RequestFailed):
                self._deliver(message.rid, TierserveError(message.message, message.field))
            elif isinstance(message, CoreFailed):
                logger.error("the engine core failed: %s", message.message)
                self._fail(EngineDeadError("the engine core failed in a step; see the server log"))
        if not self._stopping:
            code = self.core.proc.wait()
            self._fail(EngineDeadError(f"the engine core exited with status {code}"))

    def _hung(self, timeout_s: float) -> None:
        """On the watchdog's thread: the core is stuck in a step. It is killed (its ranks die
        with it), so the server goes the way a dead core takes it."""
        self._fail(EngineHungError(f"no engine step completed in {timeout_s:g} s"))
        self.core.kill()

    def _fail(self, err: BaseException) -> None:
        """Say so everywhere, once: every stream and waiting call gets its 503."""
        with self._lock:
            if self.error is not None:
                return
            self.error = err
            asks, self._asks = self._asks, {}
        self._held_ids.release_all()  # each waiter then sees the error
        logger.error("the engine failed; the server now answers 503: %s", err)
        for rid in list(self._streams):
            self._deliver(rid, err)
        for future in asks.values():
            future.set_exception(_dead(err))
        if self.on_failure is not None:
            self.on_failure()

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
                    self._forget(stream.builder.request_id)

    def _build_outputs(self, items: list[tuple[Stream, StepOutput]]) -> None:
        """On the event loop: token ids to text, stop strings, and the abort they cause."""
        for stream, step in items:
            try:
                out = stream.builder.add(step)
            except Exception as err:  # a detokenizer failure ends this request, not the loop
                logger.exception("building the output of %s failed", step.request_id)
                self._abort(step.request_id)
                stream.outputs.put(err)
                continue
            if out is None:
                continue
            if stream.builder.stopped_here:
                self._abort(step.request_id)
            stream.outputs.put(out)

    def _deliver(self, rid: str, item: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put, item)
        except RuntimeError:  # that event loop is closed
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._abort(rid)


@dataclass(frozen=True)
class Stream:
    """Where one request's outputs go: its event loop, its pending outputs, and its text state."""

    loop: asyncio.AbstractEventLoop
    outputs: PendingOutputs
    builder: OutputBuilder
