"""What stands before the routes, as plain ASGI middleware: the API key and the body limit.

Plain ASGI, not Starlette's BaseHTTPMiddleware, because that one hides a client's disconnect
from the route (non-streaming requests of a client that left ran to the end). Both refuse with
OpenAI's error JSON before the body is read.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Routes that need the key when the server has one (vLLM's choice: health and metrics stay open
# for load balancers and scrapers).
PROTECTED = ("/v1/", "/generate", "/flush_cache")


async def send_error(send: Send, status: int, message: str, kind: str, **headers: str) -> None:
    error: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": status}
    payload = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class ApiKey:
    """`Authorization: Bearer KEY` on the protected routes, compared in constant time."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key (Authorization: Bearer ...)"
                await send_error(send, 401, message, "AuthError", **{"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Counts the bytes actually received, so a chunked body (no Content-Length) is held to the
    limit too; every other message passes untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared(scope) > self.max_bytes:
            await self._refuse(send)
            return
        received, over, started = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True  # the app sees a client that left; the client gets a 413
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(send)

    @staticmethod
    def _declared(scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                return int(value)
        return 0

    async def _refuse(self, send: Send) -> None:
        body: dict[str, Any] = {
            "error": {
                "message": f"request body over {self.max_bytes} bytes",
                "type": "invalid_request_error",
                "param": None,
                "code": 413,
            }
        }
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
