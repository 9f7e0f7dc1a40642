"""Token counts a client-side job (`tierserve batch`, `--regenerate`) adds up from the
server's `usage` blocks, and the cache hit rate they give."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class JobUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += details.get("cached_tokens", 0) or 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
