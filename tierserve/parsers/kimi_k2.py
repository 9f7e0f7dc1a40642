"""Kimi-K2's and K2.5's calls: inside `<|tool_calls_section_begin|>` … `<|tool_calls_section_end|>`,
each call is `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}
<|tool_call_end|>` (Kimi-K2's tool-call guidance). The id is `functions.NAME:INDEX` as the
model wrote it: the chat template writes it back into the history. A model that writes one id
twice (`functions.f:0` for two calls) gets the second as `functions.f:N`, the first N from the
call's index on that no call of the reply has."""

from __future__ import annotations

from tierserve.parsers.base import (
    Body,
    ToolParser,
    arguments_text,
    is_name,
    json_object,
    register_tool_parser,
)

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    needs_special_tokens = True  # its markers are special tokens
    structural_tag = "kimi"

    def read_body(self, body: str) -> Body | None:
        call_id, sep, arguments = body.partition(ARGUMENT_BEGIN)
        call_id = call_id.strip()
        qualified, colon, index = call_id.rpartition(":")
        if not sep or not colon or not index.isdigit():
            return None
        name = qualified.split(".", 1)[1] if qualified.startswith("functions.") else qualified
        parsed = json_object(arguments)
        if not is_name(name) or parsed is None:
            return None
        return Body(name, arguments_text(parsed), id=call_id)

    def another_id(self, body: Body, index: int, taken: set[str]) -> str:
        n = index
        while f"functions.{body.name}:{n}" in taken:
            n += 1
        return f"functions.{body.name}:{n}"
