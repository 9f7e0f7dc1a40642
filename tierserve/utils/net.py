"""Ports: a free one on loopback for the processes tierserve starts beside itself (servers in a
benchmark, a mooncake_master), and the server's own listening socket, bound before it loads."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

from tierserve.errors import TierserveError

# Linux's default ephemeral range, where the kernel picks ports for outgoing connections.
_DEFAULT_EPHEMERAL = (32768, 60999)
# Mooncake's clients choose their own ports between ~12000 and ~17000, by trying them.
_LOWEST = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nobody holds now, chosen below the ephemeral range: a port the kernel hands out
    is soon handed again, to any outgoing connection (gloo's, Mooncake's, an HTTP client's),
    between this call and the bind of the process it is meant for. Random, so that parallel
    callers seldom pick the same one."""
    low, high = _ephemeral_range()
    ranges = [(a, b) for a, b in ((_LOWEST, low - 1), (high + 1, 65535)) if b - a >= 1000]
    for _ in range(100 if ranges else 0):
        port = random.randint(*random.choice(ranges))
        if _bindable(port):
            return port
    with socket.socket() as s:  # a crowded range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """A TCP port number: getaddrinfo takes 70000 as 4464 (mod 65536) and -1 as a bad host."""
    if not 1 <= port <= 65535:
        raise TierserveError(f"--port must be in [1, 65535], got {port}", field="port")


def check_url(url: str, field: str = "url") -> None:
    """A server's root as a client flag names it (http://host:port): refused before any
    request, not after the client's retries (a missing scheme) or as a traceback (a port past
    65535)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        message = (
            f"--{field.replace('_', '-')} {url!r} is not a server's URL, e.g. http://127.0.0.1:8000"
        )
        raise TierserveError(message, field=field)


def listen_address(host: str, port: int) -> tuple:
    """`--host` and `--port` resolved as the server binds them (the dry run asks too)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise TierserveError(f"--host {host!r} does not resolve: {err}", field="host") from err


def bind_server_socket(host: str, port: int) -> socket.socket:
    """The server's listening address, bound (not yet listening) before the engine loads: a
    port in use is refused at once, not after minutes of loading weights, and nothing can take
    the port while the engine loads (vLLM binds its API port first for the same reason)."""
    family, kind, proto, _, address = listen_address(host, port)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        message = f"cannot listen on {host}:{port}: {err.strerror} (is another server on it?)"
        raise TierserveError(message, field="port") from err
    sock.set_inheritable(False)
    return sock
