"""`/v1/completions`: OpenAI's text completions (one prompt or a batch of them, `n` choices
each, `echo`, logprobs with their text offsets)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tierserve.outputs import RequestOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams
from tierserve.server import choices
from tierserve.server.context import ServerContext
from tierserve.server.logprobs import completion_logprobs, fewer_alternatives, join
from tierserve.server.protocol import CompletionRequest
from tierserve.server.serving import Serving, per_prompt


class CompletionServing(Serving):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, ctx: ServerContext, body: CompletionRequest, params: SamplingParams) -> None:
        super().__init__(ctx, body, params)
        self.echo = body.echo
        self._offsets: dict[int, int] = {}  # per choice: characters streamed so far
        self._echoes: dict[tuple[int, ...], Any] = {}  # per prompt: its echo's logprobs

    def whole_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        echo_text, echo_logprobs = self._echoed(out, index)
        choice: dict[str, Any] = {"index": index, "text": echo_text + out.text}
        choice["logprobs"] = join(echo_logprobs, self._logprobs(out.logprobs, index))
        choice["finish_reason"] = out.finish_reason
        choice["stop_reason"] = out.stop_reason  # vLLM's: the stop string or token id
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.scored_prompt(out)
        if self.return_token_ids:  # vLLM's: the output's ids and its prompt's
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        return choice

    def chunk_choice(self, out: RequestOutput, first: bool, index: int) -> dict[str, Any] | None:
        echo_text, echo_logprobs = self._echoed(out, index) if first else ("", None)
        choice: dict[str, Any] = {"index": index, "text": echo_text + out.text_delta}
        choice["logprobs"] = join(echo_logprobs, self._logprobs(out.new_logprobs, index))
        choice["finish_reason"] = out.finish_reason if out.finished else None
        choice["stop_reason"] = out.stop_reason
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
            lps = fewer_alternatives(lps, self.logprobs_k or 0)
            return completion_logprobs(tokenizer, lps, 0, lead=ids[0])

        body = per_prompt(self._echoes, out, make)  # never changed: join copies
        self._offsets[index] = sum(map(len, body["tokens"]))
        return text, body

    def _logprobs(self, lps: list[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        body = completion_logprobs(self.engine.tokenizer, lps, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(map(len, body["tokens"]))
        return body


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx.admit(request)
        ctx.check_model(body.model)
        params = body.sampling_params()
        prompts = body.prompts()
        serving = CompletionServing(ctx, body, params)
        if len(prompts) == 1 and body.n == 1:
            return await serving.respond(prompts[0], params, request)
        todo = choices.jobs(prompts, params, body.n)
        return await choices.respond(serving, todo, body.n, request, body.stream)
