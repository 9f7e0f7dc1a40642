"""Tool-call and reasoning parsers for the model families tierserve serves, registered by the
names SGLang's `--tool-call-parser` and `--reasoning-parser` use (vLLM's spellings too)."""

from tierserve.parsers import deepseekv3, deepseekv31, kimi_k2, qwen25, think
from tierserve.parsers.base import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParsedDelta,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from tierserve.parsers.reply import NamedToolReply, ReplyParser, RequiredToolsReply

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "NamedToolReply",
    "ParsedDelta",
    "ReasoningParser",
    "ReplyParser",
    "RequiredToolsReply",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
]
