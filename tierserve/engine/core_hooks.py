"""What other processes see of, and do to, the engine core's steps: the step clock the server's
watchdog reads, and three test-only hooks that order steps and messages from outside.

The clock is 8 bytes of memory shared with the API process (a file both map): the monotonic
time the current step started, 0 between steps. The watchdog reads it without asking the core,
so a core stuck in a step, or stopped, cannot keep it from firing.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from tierserve.utils import wait_while_held

# Tests order the engine's steps through this file: absent, steps run freely; holding T, a batch
# may start while the engine has run fewer than T batches in all (tierserve_engine_steps_total);
# past that the loop waits, still taking requests and aborts. Only the test writes the file (an
# engine that counted down in it raced the test's unlink and re-created it). Read only when the
# variable is set.
STEP_GATE_ENV = "TIERSERVE_TEST_STEP_GATE"
# Tests hold one step open through this file: while it exists, a step that has started waits
# inside (the watchdog counts the time); the core writes FILE.held once it waits there.
STEP_HOLD_ENV = "TIERSERVE_TEST_STEP_HOLD"
# Tests hold the core's intake through this file: while it exists, the core applies none of the
# messages that arrive (requests, aborts, questions) but steps what it already runs, as a core
# busy in a long step would; FILE.held holds the batches it has run in all, rewritten as it
# steps. (The step gate cannot order such races: a gated core still reads its messages.)
INTAKE_HOLD_ENV = "TIERSERVE_TEST_INTAKE_HOLD"

_CLOCK = struct.Struct("d")


class StepClock:
    """When the core's current step started, in memory the API process maps too."""

    def __init__(self, fd: int) -> None:
        os.ftruncate(fd, _CLOCK.size)
        self._map = mmap.mmap(fd, _CLOCK.size)

    def step_started(self) -> None:
        _CLOCK.pack_into(self._map, 0, time.monotonic())

    def step_ended(self) -> None:
        _CLOCK.pack_into(self._map, 0, 0.0)

    def running_for(self) -> float:
        """Seconds the current step has run, 0 between steps."""
        started = _CLOCK.unpack_from(self._map, 0)[0]
        return time.monotonic() - started if started else 0.0


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


class StepHold:
    """The test-only hold inside a step (STEP_HOLD_ENV); nothing when the variable is unset."""

    def __init__(self) -> None:
        path = os.environ.get(STEP_HOLD_ENV)
        self.path = Path(path) if path else None

    def wait(self) -> None:
        wait_while_held(self.path, f"{self.path}.held")


class IntakeHold:
    """The test-only hold on the core's intake (INTAKE_HOLD_ENV); never held when unset."""

    def __init__(self) -> None:
        path = os.environ.get(INTAKE_HOLD_ENV)
        self.path = Path(path) if path else None
        self._told: int | None = None

    def held(self, batches_run: int) -> bool:
        """Whether messages wait now; while they do, the test is told how far the core got."""
        if self.path is None or not self.path.exists():
            return False
        if batches_run != self._told:
            part = Path(f"{self.path}.held.part")
            part.write_text(str(batches_run))
            part.replace(f"{self.path}.held")  # whole when the test reads it
            self._told = batches_run
        return True
