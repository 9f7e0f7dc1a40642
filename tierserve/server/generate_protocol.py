"""SGLang's native /generate body: text or token ids, its sampling parameters in one object,
and its top-level fields (`rid`, `return_hidden_states`); those tierserve does not implement are
refused when set, never ignored."""

from __future__ import annotations

import dataclasses

from pydantic import ConfigDict, Field, StrictBool, StrictInt

from tierserve.chat import TextBody
from tierserve.errors import TierserveError
from tierserve.sampling_params import SamplingParams, StructuredOutput
from tierserve.server.protocol import SamplingKnobs


class NativeSamplingParams(SamplingKnobs):
    """SGLang's /generate sampling parameters, typed so that bad values are a 400."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = None  # SGLang's name for max_tokens; default 128 as SGLang
    min_new_tokens: int | None = None  # SGLang's name for min_tokens
    json_schema: str | None = None  # SGLang's: the schema as JSON text

    def to_params(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.max_tokens is not None:
            message = "give max_new_tokens (SGLang's) or max_tokens, not both"
            raise TierserveError(message, "max_new_tokens")
        limit = self.max_new_tokens if self.max_new_tokens is not None else self.max_tokens
        if self.min_new_tokens is not None:
            self.min_tokens = self.min_new_tokens
        schema = self.json_schema
        schema = StructuredOutput("json_schema", schema) if schema is not None else None
        return self._params(limit if limit is not None else 128, schema)


# SGLang's /generate fields that tierserve does not implement: refused when set, never ignored.
UNSUPPORTED_GENERATE_FIELDS = frozenset(
    {
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
        "image_data",
        "video_data",
        "audio_data",
        "input_embeds",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "session_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "return_routed_experts",
        "bootstrap_pair_key",
        "data_parallel_rank",
        "modalities",
        "background",
        "priority",
        "extra_key",
        "return_bytes",
        "return_entropy",
    }
)


# SGLang's fields that change no output (logging, tracking, labels), which sglang-router sends
# with every /generate (`log_metrics: true`; older releases `model`): accepted and ignored.
IGNORED_GENERATE_FIELDS = frozenset(
    {"model", "log_metrics", "no_logs", "custom_labels", "conversation_id"}
)


class GenerateRequest(TextBody):
    """SGLang's native /generate: text or token ids, sampling parameters in one object, and
    SGLang's top-level `rid` and `return_hidden_states`."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: StrictBool = False
    # The request's id (it names its hidden-states file): one in flight at a time, as SGLang.
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    return_hidden_states: StrictBool | None = None

    def prompt(self) -> str | list[int]:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_GENERATE_FIELDS:
                continue
            if name not in UNSUPPORTED_GENERATE_FIELDS:  # a typo ("sampling_param") was ignored
                raise TierserveError(f"unknown field {name!r} of /generate", name)
            # Unset by identity: `"return_logprob": 0` passed as False (0 == False).
            empty = isinstance(value, list | dict) and not value
            if not (value is None or value is False or empty):
                raise TierserveError(f"{name} is not supported", name)
        if self.text is not None and self.input_ids is None:
            return self.text
        if self.input_ids is not None and self.text is None:
            return self.input_ids
        raise TierserveError("give exactly one of text or input_ids", "text")

    def params(self) -> SamplingParams:
        params = self.sampling_params.to_params()
        top, inner = self.return_hidden_states, self.sampling_params.return_hidden_states
        if top is None:
            return params
        if inner is not None and inner != top:
            message = "return_hidden_states is given twice, differently (top level and sampling)"
            raise TierserveError(message, "return_hidden_states")
        return dataclasses.replace(params, return_hidden_states=top)
