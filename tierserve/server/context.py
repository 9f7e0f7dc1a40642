"""What every route of one server shares: its engine, metrics, model name, limits and chat
parsers, and the two checks a generating route makes first."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from tierserve.server.async_engine import AsyncEngine
from tierserve.server.metrics import ServerMetrics
from tierserve.server.tools import ChatParsers


class ModelNotFound(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class ServerLimits:
    """Who may call, and how much may wait (vLLM's and SGLang's --api-key, SGLang's
    --max-queued-requests)."""

    api_key: str | None = None
    max_queued_requests: int | None = None
    body_timeout_s: float = 30.0  # to receive a whole request body
    trust_request_chat_template: bool = False  # vLLM's flag: a request may bring its template


@dataclass(frozen=True)
class ServerContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    model: str
    limits: ServerLimits = ServerLimits()
    parsers: ChatParsers = field(default_factory=ChatParsers)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise ModelNotFound(name)

    def admit(self, request: Request) -> None:
        """Room in the waiting queue, when it is bounded (the key is checked before the body
        is read, by the middleware)."""
        limit = self.limits.max_queued_requests
        if limit is not None and self.engine.waiting() >= limit:
            raise QueueFull(f"{limit} requests are already waiting (--max-queued-requests)")
