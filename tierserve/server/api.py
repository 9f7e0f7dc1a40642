"""OpenAI-compatible HTTP routes over the AsyncEngine, plus /generate, /health, /metrics and
/flush_cache. Bad input is a 4xx with OpenAI's error JSON, never a 500."""

from __future__ import annotations

import asyncio
import importlib.metadata
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.args import EngineArgs
from tierserve.chat import ChatTemplateFields, check_tool_schemas, render
from tierserve.errors import TierserveError
from tierserve.sampling_params import SamplingParams
from tierserve.server import choices, tools
from tierserve.server.async_engine import AsyncEngine, EngineDeadError
from tierserve.server.completion import Completion
from tierserve.server.generate_protocol import GenerateRequest
from tierserve.server.grammar_pool import CompilerFailed, ShuttingDown
from tierserve.server.guards import ApiKey, BodyLimit
from tierserve.server.metrics import ServerMetrics
from tierserve.server.protocol import (
    ChatCompletionRequest,
    ChatRenderRequest,
    CompletionRequest,
    error_body,
    now,
    user_error_body,
)
from tierserve.server.tokenize import (
    Detokenize,
    TokenizeChat,
    detokenize_reply,
    text_ids,
    tokenize_body,
    tokenize_reply,
)
from tierserve.server.tools import ChatParsers
from tierserve.server.worker_info import loads, model_info, server_info

MAX_BODY_BYTES = 16 * 1024 * 1024
# /tokenize's body, read in its own form (server/tokenize.py's tokenize_body).
TOKENIZE_BODY = Body(
    description="vLLM's: {prompt, add_special_tokens, return_token_strs} or {messages, "
    "add_generation_prompt, continue_final_message, tools, chat_template_kwargs, "
    "add_special_tokens, return_token_strs}",
)
# On /get_load, when the core did not answer in time: the seconds since its values were read.
STALE_HEADER = "x-tierserve-stale-seconds"


class ModelNotFound(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


@dataclass(frozen=True)
class ServerLimits:
    """Who may call, and how much may wait (vLLM's and SGLang's --api-key, SGLang's
    --max-queued-requests)."""

    api_key: str | None = None
    max_queued_requests: int | None = None
    body_timeout_s: float = 30.0  # to receive a whole request body
    trust_request_chat_template: bool = False  # vLLM's flag: a request may bring its template


class QueueFull(Exception):
    pass


def create_app(
    engine: AsyncEngine,
    model_name: str,
    limits: ServerLimits = ServerLimits(),
    parsers: ChatParsers | None = None,
) -> FastAPI:
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
    _add_routes(app, engine, metrics, model_name, limits, parsers or ChatParsers())
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


# --- routes -------------------------------------------------------------------------------


def _add_routes(
    app: FastAPI,
    engine: AsyncEngine,
    metrics: ServerMetrics,
    model: str,
    limits: ServerLimits,
    parsers: ChatParsers,
) -> None:
    def check_model(name: str | None) -> None:
        if name is not None and name != model:
            raise ModelNotFound(name)

    def admit(request: Request) -> None:
        """Room in the waiting queue, when it is bounded (the key is checked before the body
        is read, by the middleware)."""
        limit = limits.max_queued_requests
        if limit is not None and engine.waiting() >= limit:
            raise QueueFull(f"{limit} requests are already waiting (--max-queued-requests)")

    @app.get("/health")
    async def health() -> dict[str, str]:
        if engine.error is not None:
            raise EngineDeadError(str(engine.error))
        return {"status": "ok"}

    probe: asyncio.Future | None = None

    async def generate_one_token() -> None:
        # Never a hidden-states file: probes are open without the key on a capturing server.
        params = SamplingParams(max_tokens=1, temperature=0, return_hidden_states=False)
        async for _ in engine.generate([0], params, f"health-generate-{uuid.uuid4().hex}"):
            pass

    @app.get("/health_generate")
    async def health_generate() -> dict[str, str]:
        """SGLang's: healthy only when the engine generates a token (a core that is up but
        stuck fails here, and past --watchdog-timeout everywhere). One probe runs at a time:
        callers that come while it runs share its verdict."""
        nonlocal probe
        if engine.error is not None:
            raise EngineDeadError(str(engine.error))
        if probe is None or probe.done():
            probe = asyncio.ensure_future(generate_one_token())
        await asyncio.shield(probe)  # a caller that leaves does not end the others' probe
        return {"status": "ok"}

    @app.get("/get_load")
    @app.get("/get_loads")
    async def get_load() -> JSONResponse:
        """Within STATE_WAIT_S: the last known load when the core does not answer in time (a
        503 here makes sglang-router drop the worker), marked by a header with its age (the
        body keeps SGLang's shape, which the router parses)."""
        families, age = await engine.recent_metrics()
        stale = {} if age == 0 else {STALE_HEADER: "unknown" if age is None else f"{age:.3f}"}
        return JSONResponse(loads(families, engine.info.page_size), headers=stale)

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name; sglang-router tries both
    async def get_server_info() -> dict[str, Any]:
        return server_info(engine.args or EngineArgs(), engine.info, model)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(engine.info)

    def card() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": now(), "owned_by": "tierserve",
                "max_model_len": engine.info.context_length}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve
    async def one_model(name: str) -> dict[str, Any]:
        check_model(name)
        return card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("tierserve")}

    @app.post("/tokenize")
    async def tokenize(raw: dict[str, Any] = TOKENIZE_BODY) -> dict[str, Any]:
        """A prompt of any length is counted, as vLLM does (`count` > `max_model_len` says it
        does not fit): the body limit bounds the work, done off the event loop."""
        body = tokenize_body(raw)
        check_model(body.model)
        if isinstance(body, TokenizeChat):
            trusted = limits.trust_request_chat_template
            special = body.add_special_tokens
            rendered = await asyncio.to_thread(_render, engine, body, trusted, special, False)
            ids = body.truncated(rendered[0])
        else:
            ids = await asyncio.to_thread(text_ids, engine.tokenizer, body)
        return tokenize_reply(engine.tokenizer, ids, body, engine.info.context_length)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict[str, str]:
        check_model(body.model)
        vocab = engine.info.vocab_size
        return await asyncio.to_thread(detokenize_reply, engine.tokenizer, body, vocab)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render(*await engine.recent_metrics())
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        tiers = await engine.flush_cache()
        return {"flushed_pages": tiers["device_pages"], "tiers": tiers}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        admit(request)
        check_model(body.model)
        params = body.sampling_params()
        prompts = body.prompts()
        stream = Completion(engine, metrics, model, body, "text_completion", params)
        if len(prompts) == 1 and body.n == 1:
            return await stream.respond(prompts[0], params, request)
        todo = choices.jobs(prompts, params, body.n)
        return await choices.respond(stream, todo, body.n, request, body.stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        admit(request)
        check_model(body.model)
        # Up to seconds of jsonschema: never on the loop that serves /health and every stream.
        await asyncio.to_thread(check_tool_schemas, body.tools)
        reply = tools.plan(body, parsers, engine.tokenizer)
        params = tools.constrained(body.sampling_params(), reply)
        trusted = limits.trust_request_chat_template
        prompt_ids, text = await asyncio.to_thread(_render, engine, body, trusted)
        make_reply = reply.make_reply
        stream = Completion(
            engine, metrics, model, body, "chat.completion", params,
            make_reply=(lambda: make_reply(text)) if make_reply is not None else None,
        )  # fmt: skip
        with tools.grammar_errors_name_tools(reply):
            if body.n == 1:
                return await stream.respond(prompt_ids, params, request)
            todo = choices.jobs([prompt_ids], params, body.n)
            return await choices.respond(stream, todo, body.n, request, body.stream)

    @app.post("/v1/chat/completions/render")
    async def render(body: ChatRenderRequest) -> dict[str, Any]:
        check_model(body.model)
        trusted = limits.trust_request_chat_template
        ids, _ = await asyncio.to_thread(_render, engine, body, trusted)
        return {"token_ids": body.truncated(ids)}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        admit(request)
        stream = Completion(engine, metrics, model, None, "generate", request_id=body.rid)
        return await stream.respond(body.prompt(), body.params(), request, stream=body.stream)


def _render(
    engine: AsyncEngine,
    body: ChatTemplateFields,
    trusted: bool,
    add_special_tokens: bool = False,
    bounded: bool = True,
) -> tuple[list[int], str]:
    """The request's prompt as token ids, and as the text they came from. `bounded`: text
    that cannot fit the context is refused before it is rendered and tokenized."""
    preparer = engine.preparer
    if bounded:
        preparer.check_text_length(sum(len(m.text()) for m in body.messages), "messages")
    text = render(engine.tokenizer, body, trusted)
    if bounded:
        preparer.check_text_length(len(text), "messages")  # as rendered, before tokenizing it
    ids = engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    if not ids:
        raise TierserveError("messages are empty", "messages")
    return ids, text
