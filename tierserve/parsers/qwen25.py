"""Qwen2.5's and Qwen3's calls (the Hermes format, vLLM's `hermes`): each call is a JSON object
`{"name": ..., "arguments": {...}}` on its own between `<tool_call>` and `</tool_call>`."""

from __future__ import annotations

from tierserve.parsers.base import (
    Body,
    ToolParser,
    arguments_text,
    json_object,
    register_tool_parser,
)


@register_tool_parser("qwen25", "hermes")
class Qwen25ToolParser(ToolParser):
    name = "qwen25"
    call_begin = "<tool_call>"
    call_end = "</tool_call>"
    structural_tag = "qwen_3"

    def read_body(self, body: str) -> Body | None:
        call = json_object(body)
        if call is None or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json_object(arguments)
        if not isinstance(arguments, dict):
            return None
        return Body(call["name"], arguments_text(arguments))
