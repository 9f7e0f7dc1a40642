"""SGLang's native `/generate`: token ids or text in, `{text, output_ids, meta_info}` out; a
stream's chunks carry the whole output so far, as SGLang's do."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tierserve.outputs import RequestOutput
from tierserve.server.context import ServerContext
from tierserve.server.generate_protocol import GenerateRequest
from tierserve.server.serving import Serving


class GenerateServing(Serving):
    object = chunk_object = "generate"
    id_prefix = "gen"

    def __init__(self, ctx: ServerContext, request_id: str | None) -> None:
        super().__init__(ctx, None, request_id=request_id)
        self._text, self._ids = "", []  # a stream's output so far

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        return _native(out, out.text, out.token_ids)

    def streamed(self, out: RequestOutput) -> None:
        self._text += out.text_delta
        self._ids += out.new_token_ids

    def chunk(self, out: RequestOutput, first: bool, index: int = 0) -> dict[str, Any] | None:
        return _native(out, self._text, self._ids)

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        return None  # meta_info carries the counts in every chunk


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        ctx.admit(request)
        serving = GenerateServing(ctx, request_id=body.rid)
        return await serving.respond(body.prompt(), body.params(), request, stream=body.stream)


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
