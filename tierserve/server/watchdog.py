"""The step watchdog (SGLang's `--watchdog-timeout`).

A step that never returns (a tensor-parallel rank stopped by SIGSTOP, a collective waiting on a
peer that hangs) used to hang every stream while /health said 200. The watchdog is a thread of
the API process that reads the core's step clock (engine/core_hooks.py) without asking the core,
and how long a message to the core has gone unanswered (a core stopped itself): once either
passes the timeout, the server kills the core, fails every request with a 503, answers /health
with 503 and exits non-zero, the way a dead core ends it. Time spent idle, or held at the test
gate, is not a step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("tierserve")

# SGLang's default. The longest step this server takes is one chunked prefill of
# --chunked-prefill-size tokens (seconds on a CPU) or a storage read bounded by its own timeout;
# a tensor-parallel collective gives up after two minutes (distributed/ranks.py) before this.
DEFAULT_WATCHDOG_TIMEOUT_S = 300.0


class StepWatchdog:
    """Calls `on_hang(seconds)` once, from its own thread, when a step outlives `timeout_s`."""

    def __init__(
        self, timeout_s: float, stalled_for: Callable[[], float], on_hang: Callable[[float], None]
    ) -> None:
        self.timeout_s = timeout_s
        self._stalled_for = stalled_for
        self._on_hang = on_hang
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="tierserve-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            if self._stalled_for() > self.timeout_s:
                message = "no engine step completed in %g s (--watchdog-timeout)"
                logger.error(message, self.timeout_s)
                self._on_hang(self.timeout_s)
                return
