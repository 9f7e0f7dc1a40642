"""What stands before the routes, as plain ASGI middleware: the API key, and the body's size,
read time and nesting depth.

Plain ASGI, not Starlette's BaseHTTPMiddleware, because that one hides a client's disconnect
from the route (non-streaming requests of a client that left ran to the end). Both answer with
OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve.server.json_depth import JsonDepthGauge

# The routes open without the key when the server has one (SGLang's choice: its health routes
# and metrics stay open for load balancers, routers' probes and scrapers). Everything else,
# /server_info and the API's docs included, needs the key.
OPEN_ROUTES = frozenset({"/health", "/health_generate", "/metrics"})


async def send_error(send: Send, status: int, message: str, kind: str, **headers: str) -> None:
    error: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": status}
    payload = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class ApiKey:
    """`Authorization: Bearer KEY` on every route but OPEN_ROUTES, compared in constant time."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].rstrip("/") not in OPEN_ROUTES:
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key (Authorization: Bearer ...)"
                await send_error(send, 401, message, "AuthError", **{"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Counts the bytes actually received, so a chunked body (no Content-Length) is held to the
    limit too, and gives the whole body `timeout_s` to arrive, so a client trickling bytes
    cannot hold a request open (413 and 408), and refuses a body that nests deeper than any
    parser or walk after it may recurse (400). Messages after the body pass untouched: the
    routes still see a disconnect at once."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared(scope) > self.max_bytes:
            await self._refuse(send, 413, f"request body over {self.max_bytes} bytes")
            return
        deadline = time.monotonic() + self.timeout_s
        received, refusal, body_done, started = 0, None, False, False
        gauge = JsonDepthGauge()

        async def guarded_receive() -> Message:
            nonlocal received, refusal, body_done
            if refusal is not None:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11
                refusal = (408, f"request body not received within {self.timeout_s:g} s")
                return {"type": "http.disconnect"}  # the app sees a client that left
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    refusal = (413, f"request body over {self.max_bytes} bytes")
                    return {"type": "http.disconnect"}
                if not gauge.feed(message.get("body", b"")):
                    refusal = (400, f"request body nests deeper than {gauge.limit} levels")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refusal is not None:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not started:
            await self._refuse(send, *refusal)

    @staticmethod
    def _declared(scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                return int(value)
        return 0

    @staticmethod
    async def _refuse(send: Send, status: int, message: str) -> None:
        await send_error(send, status, message, "invalid_request_error")
