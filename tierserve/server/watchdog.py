"""The step watchdog (SGLang's `--watchdog-timeout`) and the test-only step gate.

A step that never returns (a tensor-parallel rank stopped by SIGSTOP, a collective waiting on a
peer that hangs) used to hang every stream while /health said 200. The watchdog is a thread that
watches the engine loop's current step: once one has run longer than the timeout, the server
fails every request with a 503, answers /health with 503 and exits non-zero, the way a dead rank
ends it. Time spent idle, or held at the test gate, is not a step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tierserve")

# SGLang's default. The longest step this server takes is one chunked prefill of
# --chunked-prefill-size tokens (seconds on a CPU) or a storage read bounded by its own timeout;
# a tensor-parallel collective gives up after two minutes (distributed/ranks.py) before this.
DEFAULT_WATCHDOG_TIMEOUT_S = 300.0
# Tests order the engine's steps through this file: absent, steps run freely; holding T, a batch
# may start while the engine has run fewer than T batches in all (tierserve_engine_steps_total);
# past that the loop waits, still taking requests and aborts. Only the test writes the file (an
# engine that counted down in it raced the test's unlink and re-created it). Read only when the
# variable is set.
STEP_GATE_ENV = "TIERSERVE_TEST_STEP_GATE"


class StepWatchdog:
    """Calls `on_hang(seconds)` once, from its own thread, when a step outlives `timeout_s`."""

    def __init__(self, timeout_s: float, on_hang: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._step_started: float | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="tierserve-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                message = "no engine step completed in %g s (--watchdog-timeout)"
                logger.error(message, self.timeout_s)
                self._on_hang(self.timeout_s)
                return


class StepGate:
    """The test-only gate before each step (STEP_GATE_ENV); open when the variable is unset."""

    def __init__(self, path: str | None = None) -> None:
        path = path if path is not None else os.environ.get(STEP_GATE_ENV)
        self.path = Path(path) if path else None

    def allows(self, batches_run: int) -> bool:
        """Whether the next step may start, the engine having run `batches_run` batches."""
        if self.path is None:
            return True
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return True
        return text.isdigit() and batches_run < int(text)
