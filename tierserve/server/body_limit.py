"""A request-body limit as plain ASGI middleware.

It counts the bytes actually received, so a chunked body (no Content-Length) is held to the
limit too, and it passes every other message through untouched: a route still sees its
client's disconnect (Starlette's BaseHTTPMiddleware hides it, so non-streaming requests of a
client that left ran to the end).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
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
