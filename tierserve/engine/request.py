"""A request's state as it moves through the scheduler, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tierserve.cache.manager import KVHandle
from tierserve.engine.grammar import GrammarState
from tierserve.layers.sampler import TokenLogprob
from tierserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    arrival: int  # order of arrival; the newest running request is preempted first
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids, and EOS unless ignored
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    kv: KVHandle = field(default_factory=KVHandle)  # owned and updated by the KV cache
    max_computed: int = 0  # most tokens ever computed; more after a preemption is recompute
    cached_tokens: int | None = None  # prefix hit at first admission, as OpenAI reports it
    num_preemptions: int = 0
    prompt_text: str | None = None  # the prompt as sent, when it was text
    grammar: GrammarState | None = None  # with params.structured_output
    # Logprobs of prompt tokens 1.. as their positions are computed (prompt_logprobs asked).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def cacheable_ids(self) -> list[int]:
        """The tokens a cached prefix may cover. Prompt logprobs need the logits of every
        prompt position, which a cache hit skips: until they are all computed, only the
        positions already scored may come from the cache."""
        scored = len(self.prompt_logprobs)
        if self.params.prompt_logprobs is None or scored == len(self.prompt_ids) - 1:
            return self.all_ids
        return self.all_ids[: scored + 1]  # `match` keeps the last token out: at most `scored`

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the pool."""
        return self.kv.computed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to be fed to the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the engine says about a request after a step: the one token it sampled, and why it
    finished if it did. Token ids only; text and stop strings are the front end's
    (`engine/output.py`), so the engine's work per token stays O(1) whatever the request asks."""

    request_id: str
    token_id: int
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    num_preemptions: int
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    # With the first token, when the request asks for prompt logprobs: prompt tokens 1.. .
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result as a user sees it. Streamed outputs carry what the latest step added
    (`new_token_ids`, `text_delta`); the final one also carries the whole output (`token_ids`,
    `text`), which is what `LLM.generate` returns."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    num_preemptions: int = 0
    token_ids: list[int] = field(default_factory=list)  # the final output only
    text: str = ""  # the final output only
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # for new_token_ids
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the final output only
    # The first and the final output: the prompt as sent (None for token ids), its ids, and
    # with prompt_logprobs the logprobs of its tokens after the first.
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
