"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.errors import TierserveError


@dataclass(frozen=True)
class SamplingParams:
    """What and how much to generate. temperature 0 means greedy."""

    max_tokens: int | None = 16  # None: as many as the context (and KV pool) leave room for
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists and a single string the way OpenAI clients send them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise TierserveError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise TierserveError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise TierserveError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise TierserveError(f"top_k must be -1 (off) or >= 0, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise TierserveError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not s for s in self.stop):
            raise TierserveError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
