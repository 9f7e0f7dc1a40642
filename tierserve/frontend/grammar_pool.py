"""The server's grammar compile pool: structured outputs compile in processes of their own.

A grammar compiled in a thread could not be stopped: an enum of 500 strings of 5,000 characters
compiled for more than ten minutes after its client had left, and six of them starved plain
requests, whose tokenization shared their thread pool. Here each compile runs in a worker process
(frontend/grammar_worker.py) that is killed when its client leaves, when it outlives
`--grammar-compile-timeout` (a 400), or when the server stops; the next compile starts a fresh
one (about three seconds here: Python, torch, xgrammar and the tokenizer). Plain requests never
wait for this pool.
Compiled grammars come back in xgrammar's serialised form (what a request carries to the engine
and its ranks) and are kept, by size, for requests that ask for the same grammar.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable

from tierserve.errors import TierserveError
from tierserve.frontend.grammar import CACHE_BYTES, check_size
from tierserve.frontend.grammar_worker import (
    DEFAULT_COMPILE_TIMEOUT_S,
    READY,
    CompileJob,
    CompileResult,
    WorkerSetup,
)
from tierserve.sampling_params import StructuredOutput

logger = logging.getLogger("tierserve")

# A compiled grammar's serialised form of a large enum runs to many megabytes on one line.
LINE_LIMIT = 1 << 30
WORKER = [sys.executable, "-m", "tierserve.frontend.grammar_worker"]


class ShuttingDown(Exception):
    """The server is stopping: compiles in flight were ended (a 503, not a wait)."""


class CompilerFailed(Exception):
    """The server's compile worker died under this request twice (a 503: the server failed,
    not the request)."""


class WorkerDied(RuntimeError):
    """A compile worker exited, or its pipe broke, before it answered."""


def default_workers() -> int:
    """Half the cores, at least one: compiles must not take the engine's cores."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class CompileWorker:
    """One worker process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, setup: WorkerSetup, live: set[CompileWorker]) -> CompileWorker:
        """A ready worker; it joins `live` as soon as it exists, so that the pool can end it
        while it is still starting."""
        proc = await asyncio.create_subprocess_exec(
            *WORKER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT
        )
        worker = cls(proc)
        live.add(worker)
        try:
            await worker._send(setup.encode())
            if await proc.stdout.readline() != READY:  # type: ignore[union-attr]
                raise WorkerDied(f"grammar compile worker exited with {await proc.wait()}")
        except BaseException:
            worker.kill()
            raise
        return worker

    async def run(self, job: CompileJob) -> CompileResult:
        await self._send(job.encode())
        line = await self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise WorkerDied(f"grammar compile worker exited with {await self.proc.wait()}")
        return CompileResult.decode(line)

    async def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            if self.proc.returncode is not None:
                raise BrokenPipeError
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        # It died while idle: its pipe is broken, or asyncio has closed its transport already.
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            code = await self.proc.wait()
            raise WorkerDied(f"grammar compile worker exited with {code}") from None

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


class GrammarCompilePool:
    """`await compile(spec)` gives one request's grammar, compiled, in xgrammar's serialised
    form (what AddRequest carries)."""

    def __init__(
        self,
        setup: WorkerSetup,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        workers: int | None = None,
        first_compile: Callable[[], None] | None = None,
    ) -> None:
        """`first_compile` is called once, as the first grammar within the limits starts to
        compile (the server has the engine core load xgrammar meanwhile)."""
        self.setup = setup
        self._first_compile = first_compile
        self.timeout_s = timeout_s
        self.size = workers or default_workers()
        self.ended: Counter[str] = Counter()  # compiles ended unfinished, by reason
        self.in_flight = 0  # compiles queued or running
        self._free: list[CompileWorker] = []
        self._all: set[CompileWorker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._closed = False
        self._cached_bytes = 0

    async def compile(self, spec: StructuredOutput) -> str:
        check_size(spec)  # a 400 before any process sees it
        if self._closed:
            raise ShuttingDown("the server is shutting down: no new grammar compiles")
        if self._first_compile is not None:
            self._first_compile, first = None, self._first_compile
            first()
        key = (spec.kind, spec.source)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        self.in_flight += 1
        try:
            serialised = await self._compile_in_worker(spec)
        except asyncio.CancelledError:  # the client left, the compile queued or running
            self.ended["client_left"] += 1
            raise
        finally:
            self.in_flight -= 1
        self._keep(key, serialised)
        return serialised

    async def _compile_in_worker(self, spec: StructuredOutput) -> str:
        """A worker that dies (killed, out of memory, a crash of the compiler) costs the
        request one retry on a fresh worker; a second death is the server's failure, a 503."""
        for attempt in ("retrying on a fresh one", "twice: the request gets a 503"):
            try:
                return await self._compile_once(spec)
            except WorkerDied as err:
                self.ended["crashed"] += 1
                logger.warning("a grammar compile worker died (%s); %s", err, attempt)
        message = "the server's grammar compiler failed twice on this request; try again"
        raise CompilerFailed(message)

    async def _compile_once(self, spec: StructuredOutput) -> str:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            worker = await self._acquire()
            try:
                job = CompileJob(spec.kind, spec.source)
                result = await asyncio.wait_for(worker.run(job), self.timeout_s)
            except BaseException as err:
                self._retire(worker)
                raise self._ended(err, spec.kind) from None
            self._free.append(worker)
        if result.error is not None:
            raise TierserveError(result.error, spec.kind)
        assert result.compiled is not None
        return result.compiled

    async def _acquire(self) -> CompileWorker:
        """A free worker, or a new one; none once the server stops."""
        worker = None
        try:
            worker = self._free.pop() if self._free else await self._start_worker()
        except WorkerDied:  # it was ended while starting: the server stops, or it died
            if not self._closed:
                raise
        if self._closed:  # close() may have come during any await above
            if worker is not None:
                self._retire(worker)
            self.ended["shutdown"] += 1
            raise ShuttingDown("the server is shutting down: no new grammar compiles")
        assert worker is not None
        return worker

    def _ended(self, err: BaseException, kind: str) -> BaseException:
        """What a compile that did not finish answers: a cancel stays a cancel (the caller
        counts it), the rest are counted by why."""
        if isinstance(err, asyncio.CancelledError):
            return err
        if self._closed:
            self.ended["shutdown"] += 1
            return ShuttingDown("the server is shutting down: its compile was ended")
        if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
            self.ended["timeout"] += 1
            message = (
                f"{kind} did not compile within {self.timeout_s:g} s (--grammar-compile-timeout)"
            )
            return TierserveError(message, kind)
        return err  # WorkerDied: retried once by the caller

    async def _start_worker(self) -> CompileWorker:
        return await CompileWorker.start(self.setup, self._all)

    def _retire(self, worker: CompileWorker) -> None:
        """Kill a worker that is mid-compile; the next compile starts a fresh one."""
        worker.kill()
        self._all.discard(worker)
        logger.info("ended a grammar compile (worker pid %d)", worker.proc.pid)

    def _keep(self, key: tuple[str, str], serialised: str) -> None:
        size = len(serialised)
        if size > CACHE_BYTES:
            return
        self._cache[key] = serialised
        self._cached_bytes += size
        while self._cached_bytes > CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= len(old)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._all]

    def close(self) -> None:
        """End every compile now (SIGTERM: the server must not wait for them to finish)."""
        self._closed = True
        for worker in list(self._all):
            worker.kill()
        self._all.clear()
        self._free.clear()
