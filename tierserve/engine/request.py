"""A request's state as it moves through the scheduler, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tierserve.cache.manager import KVHandle
from tierserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tierserve.engine.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    arrival: int  # admission order; the newest running request is preempted first
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    kv: KVHandle = field(default_factory=KVHandle)  # owned and updated by the KV cache
    max_computed: int = 0  # most tokens ever computed; more after a preemption is recompute
    cached_tokens: int | None = None  # prefix hit at first admission, as OpenAI reports it
    num_preemptions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

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


@dataclass
class RequestOutput:
    """A request's result so far; `text_delta` is what was added by the latest step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    text_delta: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    num_preemptions: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
