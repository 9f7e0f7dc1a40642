"""`/v1/chat/completions` and its `/render`: messages rendered by the chat template, replies
read for tool calls and reasoning (server/tools.py), `n` choices."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tierserve.chat import ChatTemplateFields, check_tool_schemas, render
from tierserve.errors import TierserveError
from tierserve.outputs import RequestOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams
from tierserve.server import choices, tools
from tierserve.server.async_engine import AsyncEngine
from tierserve.server.context import ServerContext
from tierserve.server.logprobs import chat_logprobs
from tierserve.server.protocol import ChatCompletionRequest, ChatRenderRequest
from tierserve.server.serving import Serving
from tierserve.server.tools import Reply


class ChatServing(Serving):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(
        self,
        ctx: ServerContext,
        body: ChatCompletionRequest,
        params: SamplingParams,
        make_reply: Callable[[], Reply] | None = None,
    ) -> None:
        """`make_reply`: a reply's reader (tool calls, reasoning; server/tools.py), one per
        choice."""
        super().__init__(ctx, body, params)
        self.make_reply = make_reply
        self._replies: dict[int, Reply] = {}  # per streamed choice

    def prompt_fields(self, out: RequestOutput) -> dict[str, Any]:
        """What vLLM puts at a chat reply's top, its prompt's: the ids, the scores."""
        fields: dict[str, Any] = {}
        if self.return_token_ids:
            fields["prompt_token_ids"] = out.prompt_token_ids
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.scored_prompt(out)
        return fields

    def whole_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        reason = out.finish_reason
        if self.make_reply is not None:
            reply = self.make_reply()
            parsed = reply.feed(out.text)
            parsed += reply.finish()
            choice = {"index": index, "message": tools.message(reply, parsed)}
            reason = tools.finish_reason(reply, reason)
        else:
            choice = {"index": index, "message": {"role": "assistant", "content": out.text}}
        choice["logprobs"] = self._logprobs(out.logprobs)
        choice["finish_reason"] = reason
        choice["stop_reason"] = out.stop_reason  # vLLM's: the stop string or token id
        if self.return_token_ids:  # vLLM's: the output's ids (the prompt's are at the top)
            choice["token_ids"] = out.token_ids
        return choice

    def chunk_choice(self, out: RequestOutput, first: bool, index: int) -> dict[str, Any] | None:
        """None when a reply's reader holds all of the text (it may begin a marker) and there
        is nothing else to say."""
        reason = out.finish_reason if out.finished else None
        if self.make_reply is not None:
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
        else:
            delta = {"content": out.text_delta}
            if first:
                delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": index, "delta": delta}
        choice["logprobs"] = self._logprobs(out.new_logprobs)
        choice["finish_reason"] = reason
        choice["stop_reason"] = out.stop_reason
        return choice

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(self.engine.tokenizer, lps) if self.logprobs else None


def register(app: FastAPI, ctx: ServerContext) -> None:
    trusted = ctx.limits.trust_request_chat_template

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        ctx.admit(request)
        ctx.check_model(body.model)
        # Up to seconds of jsonschema: never on the loop that serves /health and every stream.
        await asyncio.to_thread(check_tool_schemas, body.tools)
        reply = tools.plan(body, ctx.parsers, ctx.engine.tokenizer)
        params = tools.constrained(body.sampling_params(), reply)
        prompt_ids, text = await asyncio.to_thread(render_prompt, ctx.engine, body, trusted)
        make_reply = reply.make_reply
        serving = ChatServing(
            ctx, body, params,
            make_reply=(lambda: make_reply(text)) if make_reply is not None else None,
        )  # fmt: skip
        with tools.grammar_errors_name_tools(reply):
            if body.n == 1:
                return await serving.respond(prompt_ids, params, request)
            todo = choices.jobs([prompt_ids], params, body.n)
            return await choices.respond(serving, todo, body.n, request, body.stream)

    @app.post("/v1/chat/completions/render")
    async def render(body: ChatRenderRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ids, _ = await asyncio.to_thread(render_prompt, ctx.engine, body, trusted)
        return {"token_ids": body.truncated(ids)}


def render_prompt(
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
