"""The `<think>` … `</think>` reasoning of Qwen3, DeepSeek-R1 and Kimi-K2 (Thinking, K2.5): one
format, registered under each family's name as SGLang names them."""

from __future__ import annotations

from tierserve.parsers.base import ReasoningParser, register_reasoning_parser


@register_reasoning_parser("qwen3", "deepseek-r1", "kimi_k2")
class ThinkReasoningParser(ReasoningParser):
    name = "think"
