"""DeepSeek-V3.1's calls (V3.2's too): as V3's, but the call is
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, with no `function` kind and no
fence (the V3.1 chat template)."""

from __future__ import annotations

from tierserve.parsers.base import Body, arguments_text, is_name, json_object, register_tool_parser
from tierserve.parsers.deepseekv3 import SEP, DeepSeekV3ToolParser


@register_tool_parser("deepseekv31")
class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseekv31"
    structural_tag = "deepseek_v3_1"

    def read_body(self, body: str) -> Body | None:
        name, sep, arguments = body.partition(SEP)
        parsed = json_object(arguments)
        if not sep or not is_name(name.strip()) or parsed is None:
            return None
        return Body(name.strip(), arguments_text(parsed))
