"""The API process's end of the engine core (engine/core.py): starts the core process, waits
for it to be ready, and carries messages both ways over one socket, msgpack-framed.

The core is started from a thread that lives as long as it does: its parent-death signal fires
when the thread that started it exits, so the caller's thread (an executor's, a test's) must not
be that one (distributed/ranks.py starts the ranks the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from tierserve.args import EngineArgs
from tierserve.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreInput,
    CoreOutput,
    CoreReady,
    CoreRefused,
    Shutdown,
    decode_output,
    encode,
)
from tierserve.distributed import ENV_ARGS, ENV_PARENT, start_from_lasting_thread, wait_env
from tierserve.engine import (
    CORE_MODULE,
    ENV_CLOCK_FD,
    ENV_CORE_FD,
    ENV_LOG_LEVEL,
    StepClock,
)
from tierserve.errors import TierserveError
from tierserve.frontend import load_tokenizer


class CoreStartError(RuntimeError):
    """The core died or failed while starting (not a refusal of the flags: that is a
    TierserveError, exit 2)."""


class CoreClient:
    def __init__(self, proc: subprocess.Popen, conn: Connection, clock: StepClock) -> None:
        self.proc = proc
        self.clock = clock
        self._conn = conn
        self._send_lock = threading.Lock()
        self._info: CoreInfo | None = None

    @classmethod
    def start(cls, args: EngineArgs, log_level: str = "info") -> CoreClient:
        """The core process, started and ready; raises TierserveError if it refused the
        start-up and CoreStartError if it died on the way."""
        core = cls.spawn(args, log_level)
        core.ready()
        return core

    @property
    def info(self) -> CoreInfo:
        assert self._info is not None, "ready() first"
        return self._info

    def tokenizer_beside(self, path: str) -> Any:
        """The tokenizer at `path` (`EngineArgs.tokenizer_dir`, what the core reads too),
        loaded on a thread while the core starts. The core's verdict on the flags comes first:
        a missing model is its refusal, not a tokenizer error."""
        loaded: list[Any] = []

        def load() -> None:
            # A failure here is raised again below by the same load, after the core's verdict.
            with contextlib.suppress(Exception):
                loaded.append(load_tokenizer(path))

        loader = threading.Thread(target=load, name="tierserve-tokenizer", daemon=True)
        loader.start()
        self.ready()
        loader.join()
        return loaded[0] if loaded else load_tokenizer(path)

    def ready(self) -> CoreInfo:
        """Wait until the core has built its engine; raises as `start` does, leaving no core."""
        try:
            self._info = self._ready()
        except BaseException:  # refused, failed, or interrupted while waiting
            self.kill()
            raise
        return self._info

    @classmethod
    def spawn(cls, args: EngineArgs, log_level: str = "info") -> CoreClient:
        """The core process, started; `ready()` waits for it. Its start-up (imports, weights,
        pools) then runs while the caller does its own."""
        ours, theirs = socket.socketpair()
        clock_file = tempfile.TemporaryFile()  # noqa: SIM115 (closed below: the map keeps it)
        env = {
            **os.environ,
            **wait_env(os.environ),  # its ranks inherit it
            ENV_ARGS: json.dumps(dataclasses.asdict(args)),
            ENV_CORE_FD: str(theirs.fileno()),
            ENV_CLOCK_FD: str(clock_file.fileno()),
            ENV_LOG_LEVEL: log_level,
            ENV_PARENT: str(os.getpid()),
        }
        cmd = [sys.executable, "-m", CORE_MODULE]
        try:
            proc = _spawn(cmd, env, (theirs.fileno(), clock_file.fileno()))
            clock = StepClock(clock_file.fileno())
        finally:
            theirs.close()
            clock_file.close()  # the map and the core keep the file
        return cls(proc, Connection(ours.detach()), clock)

    def _ready(self) -> CoreInfo:
        try:
            first = decode_output(self._conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.wait()
            message = f"the engine core exited with status {code} while starting"
            raise CoreStartError(message) from None
        if isinstance(first, CoreRefused):
            self.proc.wait()
            raise TierserveError(first.message, first.field)
        if isinstance(first, CoreFailed):
            self.proc.wait()
            raise CoreStartError(first.message)
        assert isinstance(first, CoreReady), first
        return first.info

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: CoreInput) -> None:
        """Hand a message to the core; a core that is gone is reported by `messages()`."""
        data = encode(message)
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send_bytes(data)

    def messages(self) -> Iterator[CoreOutput]:
        """What the core sends, until it closes its end (it exited or was killed)."""
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                return
            yield decode_output(data)

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ask the core to close the engine and exit; killed if it has not after `timeout_s`."""
        self.send(Shutdown())
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        self.proc.kill()
        return self.proc.wait()


def _spawn(cmd: list[str], env: dict[str, str], fds: tuple[int, ...]) -> subprocess.Popen:
    """Popen from a thread that waits for the process (see the module's docstring)."""

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, pass_fds=fds, stdin=subprocess.DEVNULL)

    def outlive(proc: subprocess.Popen) -> None:
        proc.wait()

    return start_from_lasting_thread(start, outlive, "tierserve-core-spawner")
