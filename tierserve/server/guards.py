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
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
        received, body_done, started = 0, False, False
        refusal: tuple[int, str] | None = None  # set by guarded_receive: the answer instead
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


# --- nesting ----------------------------------------------------------------------------
#
# How deeply a JSON body nests, measured on its bytes as they arrive, before anything parses it.
#
# Python's JSON parser, pydantic and our own walks recurse once per level: a body nested a few
# hundred levels deep raised RecursionError inside them (a 500). Counting brackets outside strings
# bounds every walk that comes after. Only the structural bytes are visited (a regular expression
# finds them), so a 16 MB body of long strings costs little; chunk boundaries may fall anywhere,
# inside a string or between a backslash and the byte it escapes.

# Deeper than any request a client sends (an OpenAI JSON schema allows 10 levels of objects,
# about 30 JSON levels), far below where a recursive walk runs out of stack (~500).
MAX_JSON_DEPTH = 128

_STRUCTURAL = re.compile(rb'[\[\]{}"\\]')
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = frozenset(b"[{"), frozenset(b"]}"), ord('"'), ord("\\")


class JsonDepthGauge:
    """Feed a body chunk by chunk; `too_deep` turns true once any point nests past the limit."""

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        self.limit = limit
        self.depth = 0
        self.too_deep = False
        self._in_string = False
        self._escaped = False  # the previous chunk ended on a backslash inside a string

    def feed(self, chunk: bytes) -> bool:
        """Whether the body so far stays within the limit."""
        skip = -1
        if self._escaped and chunk:
            skip, self._escaped = 0, False  # the escaped byte opens this chunk
        for match in _STRUCTURAL.finditer(chunk):
            at = match.start()
            if at == skip:
                continue
            self._step(chunk[at])
            if self._escaped and at + 1 < len(chunk):
                skip, self._escaped = at + 1, False
            if self.too_deep:
                return False
        return True

    def _step(self, byte: int) -> None:
        if self._in_string:
            if byte == _BACKSLASH:
                self._escaped = True
            elif byte == _QUOTE:
                self._in_string = False
        elif byte == _QUOTE:
            self._in_string = True
        elif byte in _OPEN:
            self.depth += 1
            self.too_deep = self.depth > self.limit
        elif byte in _CLOSE:
            self.depth -= 1
