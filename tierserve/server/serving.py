"""One request's life on the server, whatever its route: metrics, disconnects, a whole reply
or a stream of chunks. The routes' own shapes are subclasses beside it (serving_completion.py,
serving_chat.py, serving_generate.py), as vLLM splits `serving_chat` from
`serving_completion`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tierserve.errors import TierserveError
from tierserve.outputs import RequestOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams
from tierserve.server.async_engine import EngineDeadError
from tierserve.server.context import ServerContext
from tierserve.server.disconnect import unless_disconnected
from tierserve.server.logprobs import prompt_logprobs
from tierserve.server.protocol import (
    SSE_DONE,
    SamplingFields,
    error_body,
    new_id,
    now,
    sse,
    usage,
    user_error_body,
)


class Serving:
    """A request's life on the server; a route's subclass says what its replies look like
    (`whole_choice` and `chunk`, with `object` naming them)."""

    object = ""  # the reply's "object" (OpenAI's), set by each route's subclass
    id_prefix = ""

    def __init__(
        self,
        ctx: ServerContext,
        body: SamplingFields | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> None:
        """`request_id`: the client's own (SGLang's `rid`), else one made here."""
        self.engine, self.metrics, self.model = ctx.engine, ctx.metrics, ctx.model
        self.include_usage = bool(body and body.include_usage)
        self.stream = bool(body and body.stream)
        self.prompt_only = bool(getattr(body, "prompt_only", False))
        self.return_token_ids = bool(getattr(body, "return_token_ids", False))  # vLLM's
        self.id = request_id or new_id(self.id_prefix)
        self.created = now()
        self.logprobs_k = params.logprobs if params is not None else None
        self.logprobs = self.logprobs_k is not None
        self.prompt_logprobs: int | None = getattr(body, "prompt_logprobs", None)  # vLLM's
        self._prompt_scores: dict[tuple[int, ...], Any] = {}  # per prompt, its choices share

    async def respond(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request: Request,
        stream: bool | None = None,
    ) -> Response:
        outputs = self.tracked(prompt, params)
        # Errors in the prompt surface here, as a 400; a client that leaves while its grammar
        # compiles or its prompt is read ends that work.
        first = await unless_disconnected(anext(outputs), outputs, request)
        if first is None:
            return Response(status_code=499)
        if stream if stream is not None else self.stream:
            return StreamingResponse(self._sse(first, outputs), media_type="text/event-stream")
        last = await _until_done(first, outputs, request)
        if last is None:
            return Response(status_code=499)  # the client went away
        return await off_the_loop(lambda: self.whole(last))

    async def tracked(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        start, first_at, out = time.perf_counter(), None, None
        try:
            async for out in self.engine.generate(prompt, params, request_id or self.id):
                if first_at is None:
                    first_at = time.perf_counter()
                    self.metrics.ttft.observe(first_at - start)
                yield _without_output(out) if self.prompt_only else out
        except TierserveError:
            raise  # a 400: the request never ran, so it is neither finished nor aborted
        except BaseException:
            self._record(start, first_at, out)
            raise
        else:
            self._record(start, first_at, out)

    def _record(self, start: float, first_at: float | None, out: RequestOutput | None) -> None:
        if out is None or not out.finished:
            self.metrics.requests.labels("abort").inc()
            return
        end = time.perf_counter()
        self.metrics.requests.labels(out.finish_reason or "stop").inc()
        self.metrics.e2e.observe(end - start)
        if first_at is not None and out.num_output_tokens > 1:
            self.metrics.tpot.observe((end - first_at) / (out.num_output_tokens - 1))

    # --- what a route's subclass says -------------------------------------------------------

    def whole_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, out: RequestOutput, first: bool, index: int) -> dict[str, Any] | None:
        """One output's choice in a stream, or None when there is nothing to say yet."""
        raise NotImplementedError

    def prompt_fields(self, out: RequestOutput) -> dict[str, Any]:
        """What a whole reply carries at its top about the prompt (chat's, as vLLM's)."""
        return {}

    chunk_object = ""  # a stream chunk's "object"

    # --- replies ------------------------------------------------------------------------------

    def usage_of(self, out: RequestOutput) -> dict[str, Any]:
        return usage(out.prompt_tokens, out.num_output_tokens, out.cached_tokens)

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        body = self.envelope(self.object, [self.whole_choice(0, out)], usage=self.usage_of(out))
        body |= self.prompt_fields(out)
        if out.hidden_states_path is not None:  # vLLM's extract_hidden_states reply
            body["kv_transfer_params"] = {"hidden_states_path": out.hidden_states_path}
        return body

    def scored_prompt(self, out: RequestOutput) -> list[Any]:
        """vLLM's prompt_logprobs of the output's prompt."""
        ids, k = out.prompt_token_ids, self.prompt_logprobs or 0
        make = lambda lps: prompt_logprobs(self.engine.tokenizer, ids, lps, k)  # noqa: E731
        return per_prompt(self._prompt_scores, out, make)

    def envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **extra}

    def chunk(self, out: RequestOutput, first: bool, index: int = 0) -> dict[str, Any] | None:
        """The chunk for one output, or None when there is nothing to say yet."""
        choice = self.chunk_choice(out, first, index)
        if choice is None:
            return None
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope(self.chunk_object, [choice], **extra)

    def streamed(self, out: RequestOutput) -> None:
        """Sees every output a stream passes on (/generate keeps the whole text so far)."""

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The stream's last chunk, with the usage, when asked for."""
        if not self.include_usage:
            return None
        return self.envelope(self.chunk_object, [], usage=self.usage_of(out))

    async def _sse(
        self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[bytes, None]:
        out, is_first = first, True
        try:
            while True:
                self.streamed(out)
                if out.text_delta or out.finished or is_first or self.logprobs:
                    chunk = self.chunk(out, is_first)
                    if chunk is not None:
                        yield sse(chunk)
                        is_first = False
                if out.finished:
                    break
                try:
                    out = await anext(outputs)
                except (EngineDeadError, TierserveError) as err:
                    yield stream_error(err)
                    return
            tail = self.usage_chunk(out)
            if tail is not None:
                yield sse(tail)
            yield SSE_DONE
        finally:
            await outputs.aclose()  # a client that left aborts the request and frees its KV


def stream_error(err: EngineDeadError | TierserveError) -> bytes:
    """The last chunk of a stream whose request failed after its headers were sent: an engine
    that died, or a refusal once the request had begun (a later prompt of a batch)."""
    if isinstance(err, EngineDeadError):
        return sse(error_body(str(err), "service_unavailable", None, 503))
    return sse(user_error_body(err))


def per_prompt(
    cache: dict[tuple[int, ...], Any],
    out: RequestOutput,
    make: Callable[[list[TokenLogprob]], Any],
) -> Any:
    """What a prompt's n choices share, made once from its first choice's scores, which come
    first (choices.jobs asks that one alone for them)."""
    key = tuple(out.prompt_token_ids)
    if out.prompt_logprobs is not None or key not in cache:
        cache[key] = make(out.prompt_logprobs or [])
    return cache[key]


async def off_the_loop(body: Callable[[], dict[str, Any]]) -> Response:
    """A whole response, built and encoded in a thread: a large one (logprobs of an echoed
    prompt, n choices) once held the event loop, and /health and every stream with it, for
    15 s. msgspec encodes it (json.dumps held the GIL 2.4 s for 81 MB, msgspec 0.2 s)."""

    def encoded() -> Response:
        return Response(msgspec.json.encode(body()), media_type="application/json")

    return await asyncio.to_thread(encoded)


def _without_output(out: RequestOutput) -> RequestOutput:
    """A prompt-only request's output: the prompt's part, none of the token its step sampled."""
    empty: dict[str, Any] = dict(new_token_ids=[], token_ids=[], new_logprobs=[], logprobs=[])
    reason = "length" if out.finished else None
    return dataclasses.replace(
        out, **empty, text_delta="", text="", num_output_tokens=0, finish_reason=reason,
        stop_reason=None,
    )  # fmt: skip


async def _until_done(
    first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], request: Request
) -> RequestOutput | None:
    """The final output, or None if the client disconnects first (the request is aborted)."""
    if first.finished:
        return first

    async def drain() -> RequestOutput:
        last = first
        async for out in outputs:
            last = out
        return last

    return await unless_disconnected(drain(), outputs, request)
