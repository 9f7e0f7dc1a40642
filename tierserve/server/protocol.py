"""OpenAI-compatible request bodies, and their mapping to SamplingParams.

Fields that vLLM and SGLang accept beyond OpenAI's (top_k, min_p, ignore_eos, stop_token_ids)
are accepted too. Fields we do not implement are refused when set to a non-default value, never
silently ignored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, ClassVar, Literal, TypeVar, cast

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from tierserve.chat import ChatTemplateFields, NamedToolChoice, TextBody
from tierserve.errors import StorageFull, TierserveError
from tierserve.frontend import ResponseFormat, StructuredOutputs
from tierserve.sampling_params import SamplingParams, StructuredOutput, bias_pairs
from tierserve.server.unsupported import UNSUPPORTED_FIELDS

MAX_CHOICES = 128  # prompts × n in one request: bounded work per request


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: refused when set (not implemented)


class SamplingKnobs(TextBody):
    """The sampling fields the OpenAI routes and the native /generate share."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's spec makes these nullable and vLLM and SGLang declare them Optional:
        clients send a parameter they leave unset as null, which takes its default here too
        (it was a 400, "temperature: Input should be a valid number")."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields}

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and the output's token ids
    # SGLang's; False: no file on a capture server. Strict: "yes" is no boolean.
    return_hidden_states: StrictBool | None = None
    regex: str | None = None  # SGLang's structured output beside OpenAI's response_format
    ebnf: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    skip_special_tokens: StrictBool = True  # vLLM's
    include_stop_str_in_output: StrictBool = False  # vLLM's
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's
    bad_words: list[StrictStr] | None = None  # vLLM's

    def _structured(self, given: StructuredOutput | None) -> StructuredOutput | None:
        """At most one grammar: `given` (the route's own field), SGLang's regex or ebnf, or
        vLLM's structured_outputs."""
        named = {"regex": self.regex, "ebnf": self.ebnf}
        grammars = [(given.kind, given)] if given is not None else []
        grammars += [(k, StructuredOutput(k, src)) for k, src in named.items() if src is not None]
        if self.structured_outputs is not None:
            grammars.append(("structured_outputs", self.structured_outputs.structured()))
        if len(grammars) > 1:
            fields = " and ".join(name for name, _ in grammars)
            raise TierserveError(f"give one structured output, not {fields}", grammars[1][0])
        return grammars[0][1] if grammars else None

    def _params(
        self, max_tokens: int | None, structured: StructuredOutput | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=bias_pairs(self.logit_bias or ()),
            structured_output=self._structured(structured),
            return_hidden_states=self.return_hidden_states,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=_tuple(self.allowed_token_ids),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=_tuple(self.bad_words),
        )


class SamplingFields(SamplingKnobs):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: not streamed
    user: str | None = None
    response_format: ResponseFormat | None = None

    def sampling_params(self) -> SamplingParams:
        """Without max_tokens a request may run to the end of the context, as in OpenAI."""
        self._refuse_unsupported()
        structured = self.response_format.structured() if self.response_format else None
        params = self._params(self.max_tokens, structured)
        params = dataclasses.replace(params, logprobs=self.logprobs_count())
        if self.prompt_logprobs is not None:
            if self.stream:  # as vLLM: a prompt's scores come with the whole reply only
                raise TierserveError("prompt_logprobs are not streamed", "prompt_logprobs")
            params = dataclasses.replace(params, prompt_logprobs=self.prompt_logprobs)
        return params

    def logprobs_count(self) -> int | None:
        """Completions: `logprobs` is how many alternatives (0: the sampled token's only)."""
        value = self.logprobs
        if value is None or value is False:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TierserveError("logprobs must be an integer in [0, 20]", "logprobs")
        return value

    # This route's own refusals beside UNSUPPORTED_FIELDS: the other route's fields.
    refused_here: ClassVar[dict[str, str]] = {}

    def _refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self.refused_here and value is not None:
                raise TierserveError(self.refused_here[name], name)
            if name in UNSUPPORTED_FIELDS and value not in (None, False, [], {}):
                raise TierserveError(f"{name} is not supported", name)
        if self.stream_options is not None and not self.stream:
            raise TierserveError("stream_options needs stream: true", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            message = "stream_options.continuous_usage_stats is not supported: use include_usage"
            raise TierserveError(message, "stream_options")
        if isinstance(self.n, bool) or not 1 <= self.n <= MAX_CHOICES:
            raise TierserveError(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    refused_here: ClassVar[dict[str, str]] = {
        "max_completion_tokens": "max_completion_tokens is chat's: completions take max_tokens",
    }

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: score the prompt and generate nothing (OpenAI's legacy
        completions; what older lm-evaluation-harness versions send)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        """With `echo` and `logprobs`, the prompt's tokens get logprobs too (lm-eval's
        loglikelihood requests). A prompt-only request runs one step, whose token is dropped."""
        if self.max_tokens == 0 and not self.echo:
            raise TierserveError("max_tokens 0 generates nothing: it needs echo", "max_tokens")
        if self.top_logprobs is not None:
            message = "top_logprobs is chat's: completions take logprobs: N alternatives"
            raise TierserveError(message, "top_logprobs")
        body = (
            self.model_copy(update={"max_tokens": 1, "min_tokens": 0}) if self.prompt_only else self
        )
        params = SamplingFields.sampling_params(body)
        if self.echo and params.logprobs is not None:  # the echo's: as many as asked, at least
            k = max(params.logprobs, params.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=k)
        return params

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or a batch: each its own choice(s), in order."""
        p = self.prompt
        many = isinstance(p, list) and p and isinstance(p[0], str | list)
        batch = cast("list[str | list[int]]", p) if many else [p]
        if not all(isinstance(b, str) or all(isinstance(t, int) for t in b) for b in batch):
            raise TierserveError("prompt must be a string, token ids, or a list of those", "prompt")
        if len(batch) * self.n > MAX_CHOICES:
            message = f"{len(batch)} prompts × n {self.n} > {MAX_CHOICES} choices in one request"
            raise TierserveError(message, "prompt")
        return batch  # type: ignore[return-value]


class ChatRenderRequest(ChatTemplateFields):
    """vLLM's /v1/chat/completions/render: the token ids a chat request would run on."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    truncation_side: Literal["left", "right"] = "left"

    def truncated(self, ids: list[int]) -> list[int]:
        keep = self.truncate_prompt_tokens
        if keep is None or len(ids) <= keep:
            return ids
        return ids[-keep:] if self.truncation_side == "left" else ids[:keep]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_completion_tokens: int | None = None
    # Unset: "auto" when tools are given, "none" when not (OpenAI's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    refused_here: ClassVar[dict[str, str]] = {
        "echo": "echo is not supported in chat completions (completions echo their prompt)",
    }

    def sampling_params(self) -> SamplingParams:
        # OpenAI's newer name wins when both are given, as in vLLM (speculators'
        # regenerate-responses sends max_tokens as a context budget beside it).
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:  # named as sent (its check is max_tokens')
                message = f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}"
                raise TierserveError(message, "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params()

    def logprobs_count(self) -> int | None:
        """Chat: `logprobs: true` asks for them, `top_logprobs` for how many alternatives."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):  # 1 == True
            raise TierserveError("logprobs must be a boolean in chat completions", "logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise TierserveError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# The event that ends a stream.
SSE_DONE = b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event: a streamed chunk's JSON, by msgspec (0.4 µs a chunk where
    json.dumps took 3; compact and UTF-8, as vLLM's chunks are)."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def user_error_body(err: TierserveError) -> dict[str, Any]:
    """A user's error as the server answers it: 507 when storage is full, else 400 (its code
    is the HTTP status, or the status a stream that had started could no longer send)."""
    if isinstance(err, StorageFull):
        return error_body(err.message, "insufficient_storage", err.field, 507)
    return error_body(err.message, "invalid_request_error", err.field, 400)


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # never unencodable
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


T = TypeVar("T")


def _tuple(values: list[T] | None) -> tuple[T, ...] | None:
    return tuple(values) if values is not None else None
