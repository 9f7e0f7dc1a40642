"""The engine core: the engine (scheduler, KV tiers, model runner; rank 0 under tensor
parallelism) in a process of its own, speaking only messages (core_messages.py) with the API
process.

The server starts it as `python -m tierserve.engine.core` with a socket to itself, the step
clock's file (core_hooks.py) and the engine args in its environment. It answers with
`CoreReady` (or `CoreRefused`, and exits 2), then loops: take what arrived, step, send that
step's outputs in one message. A reader thread takes messages off the socket while a step runs,
so the API process never waits on a step to hand one over.

It dies with the API process (a parent-death signal) and ignores SIGINT and SIGTERM: a terminal's
Ctrl-C or a supervisor's SIGTERM to the process group reaches the API process too, which drains
its requests and then sends `Shutdown`. Why a process: docs/server.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tierserve.core_messages import (
    AbortRequest,
    AddRequest,
    Answer,
    Ask,
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    CoreRefused,
    FlushCache,
    RequestFailed,
    Shutdown,
    StepOutputs,
    decode_input,
    encode,
)

# Light imports only up here: torch and the model load after the parent-death signal is armed.
from tierserve.distributed import ENV_ARGS, die_with_parent, exit_after, start_node
from tierserve.engine.core_hooks import IntakeHold, StepClock, StepGate, StepHold
from tierserve.engine.metrics import engine_metrics
from tierserve.errors import TierserveError
from tierserve.outputs import StepOutput

if TYPE_CHECKING:
    from tierserve.engine.engine import Engine

ENV_CORE_FD = "TIERSERVE_CORE_FD"  # the socket to the API process
ENV_CLOCK_FD = "TIERSERVE_CLOCK_FD"  # the step clock's file
ENV_LOG_LEVEL = "TIERSERVE_LOG_LEVEL"
CORE_MODULE = "tierserve.engine.core"

logger = logging.getLogger("tierserve")


def main() -> int:
    die_with_parent()  # first: the API process may already be gone, or go while torch loads
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = os.environ.get(ENV_LOG_LEVEL, "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    from tierserve.args import EngineArgs

    conn = Connection(int(os.environ[ENV_CORE_FD]))
    clock = StepClock(int(os.environ[ENV_CLOCK_FD]))
    try:
        # The node's other ranks first: their imports run beside this process's.
        args = EngineArgs(**json.loads(os.environ[ENV_ARGS]))
        node = start_node(args, serving=True, spawn_ranks=True)
        from tierserve.engine.engine import Engine

        engine = Engine(node.args, serving=True, node=node)
    except TierserveError as err:
        conn.send_bytes(encode(CoreRefused(err.message, err.field)))
        return 2
    except BaseException as err:  # a bug or a machine fault: the server says it and exits 1
        logger.exception("the engine core failed to start")
        conn.send_bytes(encode(CoreFailed(f"the engine core failed to start: {err!r}")))
        return 1
    conn.send_bytes(encode(CoreReady(engine.info)))
    try:
        EngineCore(engine, conn, clock).run()
    except BaseException as err:  # a bug, not bad input: say so, then stop
        logger.exception("engine loop failed; the server now answers 503")
        # A rank that died fails its peers' collectives with a gloo socket error: name it.
        why = node.ranks.dead() if node.ranks is not None and node.ranks.workers else None
        if why:
            logger.error("%s", why)
        with contextlib.suppress(OSError):  # the API process may be gone already
            conn.send_bytes(encode(CoreFailed(f"engine loop failed: {why or repr(err)}")))
        engine.abandon_storage()
        return 1
    return 0


class EngineCore:
    def __init__(self, engine: Engine, conn: Connection, clock: StepClock) -> None:
        self.engine = engine
        self.conn = conn
        self.clock = clock
        self.gate = StepGate()
        self.hold = StepHold()
        self.intake = IntakeHold()
        self.inbox: queue.SimpleQueue[CoreInput | None] = queue.SimpleQueue()  # None: EOF
        self.adds_taken = 0
        self.aborts_taken = 0
        self.stopping = False

    def run(self) -> None:
        threading.Thread(target=self._read, name="tierserve-core-reader", daemon=True).start()
        engine = self.engine
        while not self.stopping:
            idle = not engine.has_unfinished()
            steps = engine.scheduler.stats.num_steps
            held = not idle and not self.gate.allows(steps)
            if self.intake.held(steps):
                took = False
                if idle or held:
                    time.sleep(0.01)  # a test's hold: nothing to do until it ends
            else:
                took = self._take(None if idle else 0.01 if held else 0.0)
            if self.stopping:
                break
            if idle or held:
                if took:  # admission reads the queue the new requests joined
                    self._report([])
                continue
            self._report(self._steps())
        engine.close()

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(decode_input(self.conn.recv_bytes()))
        except (EOFError, OSError):  # the API process closed its end, or is gone
            self.inbox.put(None)
        except Exception:  # a message that does not decode is a bug: stop rather than hang
            logger.exception("the engine core could not read a message; it stops")
            self.inbox.put(None)

    def _take(self, timeout: float | None) -> bool:
        """Apply every message that has arrived, waiting up to `timeout` (None: forever) for
        the first; whether there was one."""
        try:
            first = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return False
        self._apply(first)
        while not self.stopping:
            try:
                self._apply(self.inbox.get_nowait())
            except queue.Empty:
                break
        return True

    def _apply(self, message: CoreInput | None) -> None:
        engine = self.engine
        if message is None or isinstance(message, Shutdown):
            self.stopping = True
        elif isinstance(message, AddRequest):
            self.adds_taken += 1
            try:
                engine.handle(message)
            except TierserveError as err:
                self._send(RequestFailed(message.rid, err.message, err.field))
        elif isinstance(message, Ask):
            if isinstance(message.query, FlushCache):
                self._send(Answer(message.ask_id, tiers=engine.flush_cache()))
            else:
                self._send(Answer(message.ask_id, metrics=engine_metrics(engine)))
        else:  # AbortRequest, PrepareGrammars
            engine.handle(message)
            self.aborts_taken += isinstance(message, AbortRequest)

    def _steps(self) -> list[StepOutput]:
        """A step, then, while every request only decodes, up to --num-continuous-decode-steps
        − 1 more before new requests are read and the tokens sent (SGLang's loop): one message
        each way per N tokens of every request."""
        engine = self.engine
        outputs = self._step()
        for _ in range(engine.args.num_continuous_decode_steps - 1):
            if not engine.decoding_only() or not self.gate.allows(engine.scheduler.stats.num_steps):
                break
            outputs += self._step()
        return outputs

    def _step(self) -> list[StepOutput]:
        self.clock.step_started()
        try:
            self.hold.wait()
            return self.engine.step()
        finally:
            self.clock.step_ended()

    def _report(self, outputs: list[StepOutput]) -> None:
        waiting = self.engine.num_waiting()
        self._send(StepOutputs(outputs, waiting, self.adds_taken, self.aborts_taken))

    def _send(self, message: CoreOutput) -> None:
        self.conn.send_bytes(encode(message))


if __name__ == "__main__":
    exit_after(main())
