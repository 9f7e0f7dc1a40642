"""vLLM's /tokenize and /detokenize: a prompt's token ids as the server reads it (plain text,
or chat messages as the template renders them), and token ids back to text, so that a client
can count and cut prompts the way the server will."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import StrictBool, StrictInt, ValidationError

from tierserve.chat import TextBody
from tierserve.errors import TierserveError
from tierserve.server.context import ServerContext
from tierserve.server.protocol import ChatRenderRequest
from tierserve.server.serving_chat import render_prompt

# /tokenize's body, read in its own form (tokenize_body).
TOKENIZE_BODY = Body(
    description="vLLM's: {prompt, add_special_tokens, return_token_strs} or {messages, "
    "add_generation_prompt, continue_final_message, tools, chat_template_kwargs, "
    "add_special_tokens, return_token_strs}",
)


class TokenizeText(TextBody):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # vLLM's default for a plain prompt, as completions
    return_token_strs: StrictBool = False


class TokenizeChat(ChatRenderRequest):
    return_token_strs: StrictBool = False
    # vLLM's default for chat: the template writes the special tokens it wants.
    add_special_tokens: StrictBool = False


def tokenize_body(data: dict[str, Any]) -> TokenizeText | TokenizeChat:
    """The body in its form, chat messages or a plain prompt, read as that form alone: as a
    union every malformed chat body was reported as the plain form's missing `prompt`."""
    if "messages" in data and "prompt" in data:
        raise TierserveError("give prompt or messages, not both", "messages")
    form = TokenizeChat if "messages" in data else TokenizeText
    try:
        return form.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


class Detokenize(TextBody):
    model: str | None = None
    tokens: list[StrictInt]


def tokenize_reply(tokenizer: Any, ids: list[int], body: TokenizeText | TokenizeChat,
                   context_length: int) -> dict[str, Any]:  # fmt: skip
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": context_length, "tokens": ids, "token_strs": strs}


def text_ids(tokenizer: Any, body: TokenizeText) -> list[int]:
    """The ids a completion would run on (with the tokenizer's BOS unless told otherwise)."""
    return tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids


def detokenize_reply(tokenizer: Any, body: Detokenize, vocab_size: int) -> dict[str, str]:
    """Off the event loop: a body's millions of ids take seconds to decode."""
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise TierserveError(f"tokens must be ids in [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def register(app: FastAPI, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/tokenize")
    async def tokenize(raw: dict[str, Any] = TOKENIZE_BODY) -> dict[str, Any]:
        """A prompt of any length is counted, as vLLM does (`count` > `max_model_len` says it
        does not fit): the body limit bounds the work, done off the event loop."""
        body = tokenize_body(raw)
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChat):
            trusted = ctx.limits.trust_request_chat_template
            special = body.add_special_tokens
            args = (engine, body, trusted, special, False)
            rendered = await asyncio.to_thread(render_prompt, *args)
            ids = body.truncated(rendered[0])
        else:
            ids = await asyncio.to_thread(text_ids, engine.tokenizer, body)
        return tokenize_reply(engine.tokenizer, ids, body, engine.info.context_length)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict[str, str]:
        ctx.check_model(body.model)
        vocab = engine.info.vocab_size
        return await asyncio.to_thread(detokenize_reply, engine.tokenizer, body, vocab)
