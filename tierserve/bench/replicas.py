"""Replicas behind the real sglang-router: N `tierserve serve` processes, optionally attached to
one Mooncake Store they share, and an `smg launch` process in front of them, started and stopped
together. `tierserve bench compare` runs a workload against the router's URL as against a
single server's.

Names of replica configurations: `replicas-N-POLICY`, and `replicas-N-POLICY-store` for the
shared store; POLICY is one of sglang-router's (`round_robin`, `cache_aware`, `random`,
`power_of_two`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tierserve.bench.client import parse_prometheus
from tierserve.bench.server_process import LoggedProcess, ServerProcess
from tierserve.errors import TierserveError
from tierserve.storage import MooncakeMaster
from tierserve.utils import free_port

ROUTER_POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")
ROUTER_HINT = "replicas run behind sglang-router: pip install 'sglang-router>=0.3.2,<0.4'"
WRITE_QUEUE = "tierserve_storage_write_queue_pages"


@dataclass(frozen=True)
class ReplicaLayout:
    replicas: int
    policy: str
    shared_store: bool

    @classmethod
    def parse(cls, name: str) -> ReplicaLayout | None:
        """The layout a configuration name asks for; None for a name that is not one."""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "replicas":
            return None
        store = parts[-1] == "store"
        policy = "-".join(parts[2 : len(parts) - store])
        if not parts[1].isdecimal() or int(parts[1]) < 1 or policy not in ROUTER_POLICIES:
            raise TierserveError(
                f"bad replicas configuration {name!r}: replicas-N-POLICY[-store], POLICY one "
                f"of {', '.join(ROUTER_POLICIES)}",
                "configs",
            )
        return cls(int(parts[1]), policy, store)

    def describe(self) -> str:
        store = ", one Mooncake Store shared" if self.shared_store else ""
        return f"{self.replicas} replicas behind sglang-router --policy {self.policy}{store}"


def router_binary() -> str:
    beside = Path(sys.executable).parent / "smg"  # installed in the same virtualenv
    found = shutil.which("smg") or (str(beside) if beside.exists() else None)
    if found is None:
        raise TierserveError(f"sglang-router's smg is not installed: {ROUTER_HINT}", "configs")
    return found


class Router(LoggedProcess):
    """`smg launch` in front of `workers`, ready once every worker is healthy in its registry."""

    stop_timeout_s = 30.0

    def __init__(
        self,
        workers: Sequence[str],
        policy: str,
        log_path: Path,
        flags: Sequence[str] = (),
        startup_timeout_s: float = 120,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the workers' --api-key; the router sends it to them and asks it of its
        own clients (smg's --api-key)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = [router_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker-urls", *workers, "--policy", policy]
        cmd += ["--prometheus-port", str(free_port()), *flags]
        cmd += ["--api-key", api_key] if api_key else []
        self._launch(cmd, log_path, None)
        try:
            self._wait_ready(len(workers), startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def workers(self) -> list[dict]:
        """The router's registry (`GET /workers`)."""
        reply = self.http.get(f"{self.url}/workers", headers=self.headers, timeout=5)
        return reply.json().get("workers", [])

    def _wait_ready(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TierserveError(f"the router exited: {self.log_tail()}", "configs")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                healthy = [w for w in self.workers() if w.get("is_healthy")]
                if len(healthy) >= count:
                    return
            time.sleep(0.2)
        raise TierserveError(f"the router found no {count} healthy workers: {self.log_tail()}")


class ReplicaSet:
    """The store (when shared), the replicas and the router, up together; `url` is the
    router's."""

    def __init__(
        self,
        model: str,
        layout: ReplicaLayout,
        flags: Sequence[str],
        logs: Path,
        name: str,
        store_extra: Mapping[str, Any] | None = None,  # tier keys beside the store's address
    ) -> None:
        self.layout = layout
        self.master: MooncakeMaster | None = None
        self.servers: list[ServerProcess] = []
        self.router: Router | None = None
        try:
            flags = list(flags)
            if layout.shared_store:
                self.master = MooncakeMaster()
                flags += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
                extra = self.master.extra(**(store_extra or {}))
                flags += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
            env = _cpu_share(layout.replicas)
            for i in range(layout.replicas):
                log = logs / f"{name}.replica{i}.log"
                self.servers.append(ServerProcess(model, flags, log, env=env))
            urls = [s.url for s in self.servers]
            self.router = Router(urls, layout.policy, logs / f"{name}.router.log")
        except BaseException:
            self.stop()
            raise
        self.url = self.router.url

    def drain_writes(self, timeout_s: float = 120) -> bool:
        """Wait until no replica has pages queued for the store (read from its /metrics)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(_queued_writes(s.url) == 0 for s in self.servers):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in self.servers:
            s.stop()
        if self.master is not None:
            self.master.stop()

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cpu_share(replicas: int) -> dict[str, str] | None:
    """Without a GPU the replicas share this machine's cores: each gets its share of them as
    torch's threads (unless OMP_NUM_THREADS says otherwise), as each would get its own device,
    instead of every replica's threads contending for every core."""
    import torch

    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return None
    share = max(1, (os.cpu_count() or 1) // replicas)
    return {**os.environ, "OMP_NUM_THREADS": str(share)}


def _queued_writes(url: str) -> float:
    metrics = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
    return metrics.get(WRITE_QUEUE, 0.0)
