"""What comes out of the engine: a sampled token's logprobs, a step's output per request
(token ids only), and a request's output as a user sees it (`LLM.generate`, the server)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely tokens', from the raw logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + the tokens more likely than it (vLLM's rank)


class StepOutput(msgspec.Struct, frozen=True, array_like=True):
    """What the engine says about a request after a step: the one token it sampled, and why it
    finished if it did. Token ids only; text and stop strings are the front end's
    (`frontend/output.py`), so the engine's work per token stays O(1) whatever the request asks.
    A msgspec struct, encoded as an array: the engine makes one per token and the core sends
    them all, and a frozen dataclass took 1.3 µs to make where this takes 0.25 (64 of them
    encode in a third of the time and decode in half)."""

    request_id: str
    token_id: int
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    num_preemptions: int
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    # With the first token, when the request asks for prompt logprobs: prompt tokens 1.. .
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # With the first token, on a server that captures hidden states: the prompt's file.
    hidden_states_path: str | None = None
    # With speculative decoding: the request's steps so far that emitted tokens (SGLang's
    # spec_verify_ct; output tokens / this = its spec_accept_length); 0 without.
    spec_verify_ct: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Logprob:
    """vLLM's entry for one token at one position (vllm.logprobs.Logprob): its log-probability
    and its rank (1: the likeliest). `decoded_token` is left None (the text is the output's)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def vllm_logprobs(lps: list[TokenLogprob]) -> list[dict[int, Logprob]]:
    """Per position, by token id: the sampled token's and the likeliest tokens' (vLLM's
    SampleLogprobs)."""
    out = []
    for lp in lps:
        entry = {t: Logprob(v, rank) for rank, (t, v) in enumerate(lp.top, 1)}
        entry.setdefault(lp.token_id, Logprob(lp.logprob, lp.rank))
        out.append(entry)
    return out


@dataclass(frozen=True)
class CompletionOutput:
    """A request's one sample as vLLM's offline API shapes it (`out.outputs[0].text`,
    `.logprobs[i][token_id].logprob`), for code written against vLLM; RequestOutput itself
    has the same in tierserve's shape."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None  # None where the request asked for none
    cumulative_logprob: float | None  # the sampled tokens' logprobs summed, where asked
    stop_reason: int | str | None = None  # RequestOutput's


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
    # vLLM's: the stop string or the stop_token_ids id that ended the request; None for EOS,
    # a grammar's end, a length.
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)  # the final output only
    text: str = ""  # the final output only
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # for new_token_ids
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the final output only
    # The first and the final output: the prompt as sent (None for token ids), its ids, and
    # with prompt_logprobs the logprobs of its tokens after the first.
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    # On a server that captures hidden states (--hidden-states-dir): the prompt's safetensors
    # file, in the first and the final output (engine/hidden_states.py).
    hidden_states_path: str | None = None
    spec_verify_ct: int = 0  # with speculative decoding: steps that emitted tokens, so far
    # With SamplingParams.n > 1 offline: every sample (the fields above are the first's).
    samples: list[CompletionOutput] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: a list of samples, `n` of them (one unless SamplingParams.n says)."""
        return self.samples if self.samples is not None else [self.as_sample(0)]

    def as_sample(self, index: int) -> CompletionOutput:
        """This output as sample `index` of its prompt's."""
        asked = bool(self.logprobs)
        total = sum(t.logprob for t in self.logprobs) if asked else None
        return CompletionOutput(
            index, self.text, self.token_ids, self.finish_reason,
            vllm_logprobs(self.logprobs) if asked else None, total, self.stop_reason,
        )  # fmt: skip

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the next as one, as if they were one step's: what a stream that
        fell behind sends (vLLM merges a slow consumer's outputs the same way). The deltas
        join; the rest is the later one's, but the prompt's fields the first output carries."""
        first = bool(self.prompt_token_ids)  # the first output carries the prompt's ids
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text_delta=self.text_delta + later.text_delta,
            new_logprobs=self.new_logprobs + later.new_logprobs,
            prompt=self.prompt if first else later.prompt,
            prompt_token_ids=self.prompt_token_ids if first else later.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs if first else later.prompt_logprobs,
            hidden_states_path=self.hidden_states_path or later.hidden_states_path,
        )
