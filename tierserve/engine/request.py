"""A request's state as it moves through the scheduler, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierserve.cache import KVHandle
from tierserve.core_messages import AddRequest
from tierserve.outputs import TokenLogprob
from tierserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API process builds requests without torch (or xgrammar) loaded
    import torch

    from tierserve.frontend import GrammarState


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
    # params.allowed_token_ids as a tensor, made at its first step (layers/sampler.py).
    allowed_ids: torch.Tensor | None = None
    # The message it was made from: rank 0 forwards it to the other ranks as it came.
    message: AddRequest | None = None
    # Logprobs of prompt tokens 1.. as their positions are computed (prompt_logprobs asked).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # On a server that captures hidden states: the prompt positions' rows captured so far
    # (each [positions, layers + 1, hidden]), and where the whole file went.
    captures: bool = False
    hidden: list[torch.Tensor] = field(default_factory=list)
    num_captured: int = 0
    hidden_states_path: str | None = None
    spec_steps: int = 0  # with speculative decoding: steps that emitted its tokens
    next_draft: tuple[int, ...] = ()  # an EAGLE-3 draft's proposal for its next step

    @property
    def may_draft(self) -> bool:
        """Whether its tokens may be drafted: not under a grammar with min_tokens (plain
        decoding lets a finished grammar's stop token past min_tokens, which a draft row
        cannot see)."""
        return not (self.grammar is not None and self.params.min_tokens)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def last_ids(self, n: int) -> list[int]:
        """The last `n` of prompt + output, without joining the whole of both (a proposer's
        look-back on a 100K-token context, every step)."""
        out = self.output_ids[-n:]
        if len(out) == n:
            return out
        return self.prompt_ids[max(0, len(self.prompt_ids) - (n - len(out))) :] + out

    @property
    def cacheable_ids(self) -> list[int]:
        """The tokens a cached prefix may cover. Prompt logprobs need the logits of every
        prompt position, and captured hidden states every position's states, which a cache hit
        skips: until they are all computed, only the positions done may come from the cache."""
        if self.captures and self.num_captured < len(self.prompt_ids):
            # Captured hidden states need every prompt position computed, as logprobs do.
            return self.all_ids[: self.num_captured + 1]
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
