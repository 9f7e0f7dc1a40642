"""`tierserve serve` (or another server, in a subclass) in a subprocess on a free port, ready
when /health answers; stopped with SIGTERM. The bench's comparisons and the benchmarks start
their servers with it."""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from tierserve.errors import TierserveError
from tierserve.utils import free_port


def local_client() -> httpx.Client:
    """A client for calls to a process on this machine. `httpx.get` builds a client, TLS
    context and all, per call (~20 CPU-ms): a loop polling with it takes a core from the
    server it waits for. It keeps no connection, so a server killed under it is a refused
    connection, as with `httpx.get`, never a stale one."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False)


def scratch_dir() -> Path:
    """A fresh directory for a benchmark's server logs and data, removed when this process
    exits (a speculators_job run left 0.75 GB in /tmp each time)."""
    path = Path(tempfile.mkdtemp(prefix="tierserve-bench-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class LoggedProcess:
    """A subprocess writing to a log file; stopped with SIGTERM, killed if it lingers."""

    stop_timeout_s = 60.0

    def _launch(self, cmd: list[str], log_path: Path, env: Mapping[str, str] | None) -> None:
        self.http = local_client()  # what polls it
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=None if env is None else dict(env)
        )

    def log_tail(self, chars: int = 1500) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.http.close()


# Launches of one server before a port taken under it is an error.
PORT_ATTEMPTS = 3


class ServerProcess(LoggedProcess):
    """`tierserve serve` in a subprocess on a free port; stopped with SIGTERM."""

    def __init__(
        self,
        model: str,
        flags: Sequence[str],
        log_path: Path,
        startup_timeout_s: float = 300,
        env: Mapping[str, str] | None = None,
    ) -> None:
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.cmd = self.command(model, flags)
            self._launch(self.cmd, log_path, env)
            try:
                self._wait_ready(startup_timeout_s)
                return
            except TierserveError as err:
                self.stop()
                # Another process took the free port before the server bound it: another one.
                if "already in use" not in str(err) or attempt + 1 == PORT_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise

    def command(self, model: str, flags: Sequence[str]) -> list[str]:
        """The server's command line on `self.port` (another server's, in a subclass)."""
        cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", model]
        return cmd + ["--port", str(self.port), "--log-level", "warning", *flags]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TierserveError(
                    f"server exited with status {self.proc.returncode}: {self.log_tail()}",
                    "server_args",
                )
            try:
                if self.http.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TierserveError(f"server not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        super().stop()
        if self.log_path.exists() and self.log_path.stat().st_size == 0:
            self.log_path.unlink()  # --log-level warning: a quiet server leaves no log

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
