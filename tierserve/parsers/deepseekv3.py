"""DeepSeek-V3's (and R1's) calls: inside `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`, each
call is `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence,
then `<｜tool▁call▁end｜>` (the V3 and R1 chat templates)."""

from __future__ import annotations

import re

from tierserve.parsers.base import (
    Body,
    ToolParser,
    arguments_text,
    is_name,
    json_object,
    register_tool_parser,
)

SEP = "<｜tool▁sep｜>"
FENCED = re.compile(r"\A(?P<name>[^\n]+)\n```json\n(?P<args>.*)\n```\s*\Z", re.DOTALL)


@register_tool_parser("deepseekv3")
class DeepSeekV3ToolParser(ToolParser):
    name = "deepseekv3"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    needs_special_tokens = True
    structural_tag = "deepseek_r1"

    def read_body(self, body: str) -> Body | None:
        kind, sep, rest = body.partition(SEP)
        match = FENCED.match(rest)
        if kind.strip() != "function" or not sep or match is None:
            return None
        parsed, name = json_object(match["args"]), match["name"].strip()
        return None if parsed is None or not is_name(name) else Body(name, arguments_text(parsed))
