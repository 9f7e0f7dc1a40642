"""One request's life on the server: metrics, disconnects, and the three response shapes
(completion, chat completion, native generate), streamed or whole."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tierserve.errors import TierserveError
from tierserve.outputs import RequestOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams
from tierserve.server import tools
from tierserve.server.async_engine import AsyncEngine, EngineDeadError
from tierserve.server.disconnect import unless_disconnected
from tierserve.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    fewer_alternatives,
    join,
    prompt_logprobs,
)
from tierserve.server.metrics import ServerMetrics
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
from tierserve.server.tools import Reply


class Completion:
    """One request's life on the server: metrics, disconnects, and the three response shapes
    (completion, chat completion, native generate), streamed or whole."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        model: str,
        body: SamplingFields | None,
        kind: str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        make_reply: Callable[[], Reply] | None = None,
    ) -> None:
        """`request_id`: the client's own (SGLang's `rid`), else one made here. `make_reply`:
        a chat reply's reader (tool calls, reasoning; server/tools.py), one per choice."""
        self.engine, self.metrics, self.model, self.kind = engine, metrics, model, kind
        self.include_usage = bool(body and body.include_usage)
        self.stream = bool(body and body.stream)
        self.echo = bool(getattr(body, "echo", False))  # completions only
        self.prompt_only = bool(getattr(body, "prompt_only", False))
        self.return_token_ids = bool(getattr(body, "return_token_ids", False))  # vLLM's
        prefix = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}.get(kind, "gen")
        self.id = request_id or new_id(prefix)
        self.created = now()
        self._text, self._ids = "", []  # a /generate stream's output so far
        self._logprobs_k = params.logprobs if params is not None else None
        self.logprobs = self._logprobs_k is not None
        self._offsets: dict[int, int] = {}  # per choice: characters streamed so far
        self.prompt_logprobs: int | None = getattr(body, "prompt_logprobs", None)  # vLLM's
        # Per prompt, what its choices share: the echo's logprobs, vLLM's prompt_logprobs.
        self._echoes: dict[tuple[int, ...], Any] = {}
        self._prompt_scores: dict[tuple[int, ...], Any] = {}
        self.make_reply = make_reply
        self._replies: dict[int, Reply] = {}  # per streamed choice

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
        return await off_the_loop(lambda: self._whole(last))

    async def tracked(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
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

    # --- response bodies ------------------------------------------------------------------

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        return usage(out.prompt_tokens, out.num_output_tokens, out.cached_tokens)

    def _whole(self, out: RequestOutput) -> dict[str, Any]:
        if self.kind == "generate":
            return _native(out, out.text, out.token_ids)
        body = self.envelope(self.kind, [self.whole_choice(0, out)], usage=self._usage(out))
        body |= self.chat_prompt_fields(out)
        if out.hidden_states_path is not None:  # vLLM's extract_hidden_states reply
            body["kv_transfer_params"] = {"hidden_states_path": out.hidden_states_path}
        return body

    def chat_prompt_fields(self, out: RequestOutput) -> dict[str, Any]:
        """What vLLM puts at a chat reply's top, its prompt's: the ids, the scores."""
        if self.kind != "chat.completion":
            return {}
        fields: dict[str, Any] = {}
        if self.return_token_ids:
            fields["prompt_token_ids"] = out.prompt_token_ids
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self._scored_prompt(out)
        return fields

    def _scored_prompt(self, out: RequestOutput) -> list[Any]:
        """vLLM's prompt_logprobs of the output's prompt."""
        ids, k = out.prompt_token_ids, self.prompt_logprobs or 0
        make = lambda lps: prompt_logprobs(self.engine.tokenizer, ids, lps, k)  # noqa: E731
        return _per_prompt(self._prompt_scores, out, make)

    def whole_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        echo_text, echo_logprobs = self._echoed(out, index)
        reason = out.finish_reason
        if self.kind == "chat.completion" and self.make_reply is not None:
            reply = self.make_reply()
            parsed = reply.feed(out.text)
            parsed += reply.finish()
            choice = {"index": index, "message": tools.message(reply, parsed)}
            reason = tools.finish_reason(reply, reason)
        elif self.kind == "chat.completion":
            choice = {"index": index, "message": {"role": "assistant", "content": out.text}}
        else:
            choice = {"index": index, "text": echo_text + out.text}
        choice["logprobs"] = join(echo_logprobs, self._logprobs(out.logprobs, index))
        choice["finish_reason"] = reason
        choice["stop_reason"] = out.stop_reason  # vLLM's: the stop string or token id
        if self.prompt_logprobs is not None and self.kind == "text_completion":
            choice["prompt_logprobs"] = self._scored_prompt(out)
        if self.return_token_ids:  # vLLM's: the output's ids; a completion's prompt's too
            choice["token_ids"] = out.token_ids
            if self.kind != "chat.completion":
                choice["prompt_token_ids"] = out.prompt_token_ids
        return choice

    def _echoed(self, out: RequestOutput, index: int) -> tuple[str, dict[str, Any] | None]:
        """With `echo`: the prompt's text (as sent, or its ids decoded) and its logprobs, the
        first token's None."""
        if not self.echo:
            return "", None
        tokenizer = self.engine.tokenizer
        ids = out.prompt_token_ids
        text = out.prompt if out.prompt is not None else tokenizer.decode(ids)
        if not self.logprobs:
            return text, None

        def make(lps: list[TokenLogprob]) -> dict[str, Any]:
            lps = fewer_alternatives(lps, self._logprobs_k or 0)
            return completion_logprobs(tokenizer, lps, 0, lead=ids[0])

        body = _per_prompt(self._echoes, out, make)  # never changed: join copies
        self._offsets[index] = sum(map(len, body["tokens"]))
        return text, body

    def _logprobs(self, lps: list[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokenizer = self.engine.tokenizer
        if self.kind == "chat.completion":
            return chat_logprobs(tokenizer, lps)
        body = completion_logprobs(tokenizer, lps, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(map(len, body["tokens"]))
        return body

    def envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **extra}

    def chunk(self, out: RequestOutput, first: bool, index: int = 0) -> dict[str, Any] | None:
        """The chunk for one output, or None when a reply's reader holds all of its text
        (it may begin a marker) and there is nothing else to say."""
        if self.kind == "generate":
            return _native(out, self._text, self._ids)
        echo_text, echo_logprobs = self._echoed(out, index) if first else ("", None)
        reason = out.finish_reason if out.finished else None
        if self.kind == "chat.completion" and self.make_reply is not None:
            reply = self._replies.setdefault(index, self.make_reply())
            parsed = reply.feed(out.text_delta)
            if out.finished:
                parsed += reply.finish()
                reason = tools.finish_reason(reply, reason)
            delta: dict[str, Any] = tools.delta_fields(parsed)
            if not (delta or first or out.finished or self.logprobs):
                return None
            if first:
                delta = {"role": "assistant", "content": "", **delta}
            choice = {"index": index, "delta": delta}
        elif self.kind == "chat.completion":
            delta = {"content": out.text_delta}
            if first:
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": echo_text + out.text_delta}
        choice["logprobs"] = join(echo_logprobs, self._logprobs(out.new_logprobs, index))
        choice["finish_reason"] = reason
        choice["stop_reason"] = out.stop_reason
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope(self.chunk_object(), [choice], **extra)

    async def _sse(
        self, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[bytes]:
        out, is_first = first, True
        try:
            while True:
                if self.kind == "generate":  # SGLang's chunks carry the whole output so far
                    self._text += out.text_delta
                    self._ids += out.new_token_ids
                if out.text_delta or out.finished or is_first or self.logprobs:
                    chunk = self.chunk(out, is_first)
                    if chunk is not None:
                        yield sse(chunk)
                        is_first = False
                if out.finished:
                    break
                try:
                    out = await anext(outputs)
                except EngineDeadError as err:  # headers are sent: say so in the stream
                    yield sse(error_body(str(err), "service_unavailable", None, 503))
                    return
                except TierserveError as err:  # refused by the engine once it had begun
                    yield sse(user_error_body(err))
                    return
            if self.include_usage and self.kind != "generate":
                tail = self.envelope(self.chunk_object(), [], usage=self._usage(out))
                yield sse(tail)
            yield SSE_DONE
        finally:
            await outputs.aclose()  # a client that left aborts the request and frees its KV

    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else self.kind


def _per_prompt(
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


def _native(out: RequestOutput, text: str, ids: list[int]) -> dict[str, Any]:
    meta = {
        "id": out.request_id,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason,
    }
    if out.hidden_states_path is not None:  # the file, where SGLang puts the states inline
        meta["hidden_states_path"] = out.hidden_states_path
    if out.spec_verify_ct:  # speculative decoding, as SGLang reports it
        meta["spec_verify_ct"] = out.spec_verify_ct
        meta["spec_accept_length"] = out.num_output_tokens / out.spec_verify_ct
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def _until_done(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput], request: Request
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
