"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierserve.errors import TierserveError

GREEDY_BELOW = 1e-5
# Per-request list limits, so one request cannot make every step slow for all (stop strings are
# matched on each new token). OpenAI allows 4 stop strings; vLLM and SGLang set no bound.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024


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
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or ()
            if not isinstance(value, list | tuple):
                raise TierserveError(f"{name} must be a list, got {value!r}", name)
            object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        self._check_types()
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
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise TierserveError(
                f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters",
                "stop",
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise TierserveError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                "stop_token_ids",
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise TierserveError(f"seed must be in [0, 2**63), got {self.seed}", "seed")

    def _check_types(self) -> None:
        """Wrong types and NaN fail here, with the field's name, not deep inside a batch."""
        ints = {"top_k": self.top_k, "max_tokens": self.max_tokens, "seed": self.seed}
        for name, value in ints.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TierserveError(f"{name} must be an integer, got {value!r}", name)
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TierserveError(f"{name} must be a number, got {value!r}", name)
            if not math.isfinite(value):
                raise TierserveError(f"{name} must be finite, got {value}", name)
        if not all(isinstance(s, str) for s in self.stop):
            raise TierserveError("stop must be a string or a list of strings", "stop")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise TierserveError("stop_token_ids must be integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        # Below this temperature float32 logits / temperature overflow: sample as greedy.
        return self.temperature < GREEDY_BELOW or self.top_k == 1
