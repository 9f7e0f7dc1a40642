"""A free TCP port on loopback, for the processes tierserve starts beside itself (servers in a
benchmark, a mooncake_master)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
