"""`mooncake`: Mooncake Store, a distributed store whose objects live in RAM segments that the
clients contribute, coordinated by `mooncake_master` (which also serves the metadata over HTTP
with `--enable_http_metadata_server=true`). Servers attached to one master share pages while
they run; an object leaves with the segment of the client that stored it.

extra config (SGLang's and Mooncake's names): `master_server_address` (default
127.0.0.1:50051), `metadata_server` (default http://127.0.0.1:8080/metadata), `protocol` (tcp),
`device_name` (""), `local_hostname` (127.0.0.1), `global_segment_size` (this node's RAM given
to the store, default 1 GiB) and `local_buffer_size` (default 128 MiB): both count in the node's
host budget.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD, StorageBackend, config_bytes
from tierserve.utils import free_port

DEFAULTS = {
    "master_server_address": "127.0.0.1:50051",
    "metadata_server": "http://127.0.0.1:8080/metadata",
    "protocol": "tcp",
    "device_name": "",
    "local_hostname": "127.0.0.1",
    "global_segment_size": 2**30,
    "local_buffer_size": 128 * 2**20,
}

MASTER_PROBE_S = 3.0  # a master on another node answers a connect in milliseconds


SIZES = {"global_segment_size", "local_buffer_size"}


def segment_bytes(extra: Mapping[str, Any]) -> int:
    """RAM a Mooncake client takes on this node: its segment plus its transfer buffer."""
    return sum(config_bytes(extra, k, DEFAULTS[k]) for k in sorted(SIZES))  # type: ignore[arg-type]


def _master(extra: Mapping[str, Any]) -> tuple[str, int] | None:
    """The master's host and port; None for an HA list (etcd://...), the client's to read."""
    address = extra.get("master_server_address", DEFAULTS["master_server_address"])
    if "://" in address or ";" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        message = f"master_server_address {address!r} must be host:port"
        raise TierserveError(message, EXTRA_FIELD)
    return host.strip("[]"), int(port)


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    config_keys = frozenset(DEFAULTS)
    tears_down = True  # it unmounts its segment through the master

    def __init__(self, extra: Mapping[str, Any]) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # the client logs every call otherwise
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as err:
            raise TierserveError(
                f"the mooncake backend needs mooncake-transfer-engine ({err}); `make install` "
                "installs it, with Debian's libibverbs1 and libnuma1",
                "hicache_storage_backend",
            ) from None
        cfg = {**DEFAULTS, **extra}
        self.preflight(cfg)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            cfg["local_hostname"],
            cfg["metadata_server"],
            config_bytes(cfg, "global_segment_size", 0),
            config_bytes(cfg, "local_buffer_size", 0),
            cfg["protocol"],
            cfg["device_name"],
            cfg["master_server_address"],
        )
        if rc != 0:
            raise TierserveError(
                f"Mooncake Store setup failed (code {rc}) with master "
                f"{cfg['master_server_address']} and metadata {cfg['metadata_server']}: is "
                "mooncake_master running there?",
                EXTRA_FIELD,
            )

    def exists(self, keys: list[str]) -> list[bool]:
        found = self.store.batch_is_exist(keys)
        if any(f < 0 for f in found):
            raise OSError("Mooncake Store could not answer is_exist")
        return [f == 1 for f in found]

    def get(self, keys: list[str]) -> list[bytes | None]:
        return [blob or None for blob in self.store.get_batch(keys)]

    def put(self, items: Mapping[str, bytes]) -> list[str]:
        # upsert, not put: put keeps an existing object, and a corrupt one must be replaced.
        rc = self.store.upsert_batch(list(items), list(items.values()))
        if rc != 0:
            raise OSError(f"Mooncake Store upsert_batch failed (code {rc})")
        return []  # the master evicts to make room: every object is stored

    def close(self) -> None:
        self.store.close()

    def answers(self) -> bool:
        # The client's own verdict (its heartbeat's: a second or so late), then one lookup,
        # which fails at once when the master has gone.
        if self.store.health_check() != 0:
            return False
        return all(f >= 0 for f in self.store.batch_is_exist(["tierserve-probe"]))

    @classmethod
    def check_config(cls, extra: Mapping[str, Any]) -> None:
        segment_bytes(extra)
        for key in DEFAULTS.keys() - SIZES:
            if not isinstance(extra.get(key, ""), str):
                message = f"{key} in the storage config must be a string, got {extra[key]!r}"
                raise TierserveError(message, EXTRA_FIELD)
        _master(extra)

    @classmethod
    def preflight(cls, extra: Mapping[str, Any]) -> None:
        """The master must accept a connection: the client's setup retries an absent one for
        ~50 s before it fails. An HA master list (etcd://...) is the client's to resolve."""
        cls.check_config(extra)
        address = _master(extra)
        if address is None:
            return
        host, port = address
        try:
            socket.create_connection((host, port), timeout=MASTER_PROBE_S).close()
        except OSError as err:
            message = (
                f"mooncake_master does not answer at {host}:{port} "
                f"({err.strerror or err}): start it, or give its master_server_address"
            )
            raise TierserveError(message, EXTRA_FIELD) from None

    @classmethod
    def ram_bytes(cls, extra: Mapping[str, Any]) -> int:
        return segment_bytes(extra)


class MooncakeMaster:
    """A `mooncake_master` on loopback with its HTTP metadata server (benchmarks, tests, and
    a one-machine setup): `extra()` is the storage config that attaches a server to it."""

    def __init__(self, port: int | None = None, http_port: int | None = None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        # A free port may be taken by another process before the master binds it: ports it
        # picked itself are picked again, twice at most.
        for attempt in range(3):
            self.port, self.http_port = port or free_port(), http_port or free_port()
            # Its metrics port defaults to 9003: a second master on the machine failed to start
            # on it (and each test of the store waited 20 s for it).
            self.metrics_port = free_port()
            try:
                self.start()
                return
            except TierserveError:
                if port or http_port or attempt == 2:
                    raise

    def start(self, timeout_s: float = 20.0) -> None:
        beside = Path(sys.executable).parent / "mooncake_master"  # installed in the venv
        binary = shutil.which("mooncake_master") or str(beside)
        cmd = [binary, "--port", str(self.port), "--enable_http_metadata_server=true",
               "--http_metadata_server_port", str(self.http_port),
               "--metrics_port", str(self.metrics_port)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise TierserveError(f"mooncake_master did not start on port {self.port}", "mooncake")

    def _answers(self) -> bool:
        """Both its ports take calls: the metadata server's comes up before the master's own,
        and a client set up in between fails (a slow or busy machine sees that gap)."""
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metadata", timeout=1)
        except urllib.error.HTTPError:
            pass  # it answers (404 for an unknown key)
        except OSError:
            return False
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def extra(self, **more: Any) -> dict[str, Any]:
        return {
            "master_server_address": f"127.0.0.1:{self.port}",
            "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
            "global_segment_size": 64 * 2**20,
            "local_buffer_size": 16 * 2**20,
            **more,
        }
