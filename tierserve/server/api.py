"""The HTTP app: OpenAI-compatible routes over the AsyncEngine, plus SGLang's /generate,
/health, /metrics and /flush_cache. Each route family registers itself from its own module;
bad input is a 4xx with OpenAI's error JSON, never a 500."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.errors import TierserveError
from tierserve.frontend import CompilerFailed, ShuttingDown
from tierserve.server import (
    serving_chat,
    serving_completion,
    serving_generate,
    tokenize,
    worker_info,
)
from tierserve.server.async_engine import AsyncEngine, EngineDeadError
from tierserve.server.context import ModelNotFound, QueueFull, ServerContext, ServerLimits
from tierserve.server.guards import ApiKey, BodyLimit
from tierserve.server.metrics import ServerMetrics
from tierserve.server.protocol import error_body, user_error_body
from tierserve.server.tools import ChatParsers

MAX_BODY_BYTES = 16 * 1024 * 1024
# Each registers its routes (`register(app, ctx)`), in this order.
ROUTES = (worker_info, tokenize, serving_completion, serving_chat, serving_generate)


def create_app(
    engine: AsyncEngine,
    model_name: str,
    limits: ServerLimits | None = None,
    parsers: ChatParsers | None = None,
) -> FastAPI:
    limits = limits or ServerLimits()
    metrics = ServerMetrics(engine.grammar_pool, model_name, engine.waiting_for_ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()  # uvicorn has drained the open requests by now

    app = FastAPI(title="tierserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, timeout_s=limits.body_timeout_s)
    if limits.api_key is not None:
        app.add_middleware(ApiKey, key=limits.api_key)
    ctx = ServerContext(engine, metrics, model_name, limits, parsers or ChatParsers())
    for routes in ROUTES:
        routes.register(app, ctx)
    return app


# --- errors -------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TierserveError)  # StorageFull too: a 507
    async def user_error(_: Request, err: TierserveError) -> JSONResponse:
        body = user_error_body(err)
        return JSONResponse(body, status_code=body["error"]["code"])

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if tuple(first.get("loc", ())) == ("body",) and "json" not in kind:
            # FastAPI reads a body as JSON only when it is labelled so (curl -d sends a form).
            message = (
                f"send the body as JSON, with Content-Type: application/json (not {kind or 'none'})"
            )
            return _error(400, message, "invalid_request_error")
        if first.get("type") == "json_invalid":
            message = f"body is not valid JSON: {first.get('msg')}"
            return _error(400, message, "invalid_request_error")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404), wrong methods (405): OpenAI's error shape, not {"detail": ...}.
        return _error(err.status_code, str(err.detail), "invalid_request_error")

    @app.exception_handler(ModelNotFound)
    async def unknown_model(_: Request, err: ModelNotFound) -> JSONResponse:
        return _error(404, f"The model `{err.name}` does not exist.", "NotFoundError", "model")

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, err: QueueFull) -> JSONResponse:
        return _error(503, str(err), "service_unavailable")

    @app.exception_handler(ShuttingDown)
    @app.exception_handler(CompilerFailed)
    async def unavailable(_: Request, err: Exception) -> JSONResponse:
        return _error(503, str(err), "service_unavailable")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return _error(503, str(err), "service_unavailable")
