"""The messages between the API process, the engine core and the tensor-parallel ranks: one
typed set, with one compact encoding (msgpack, through msgspec; nothing is pickled).

The API process tokenizes and validates a request (`RequestPreparer`), then sends an
`AddRequest` to the core; the core builds its scheduler state from it and answers with one
`StepOutputs` per step. Rank 0 (the core) forwards the engine's inputs to the other ranks, so
every rank builds the same state from the same bytes.
"""

from __future__ import annotations

from typing import Union

import msgspec

from tierserve.outputs import StepOutput
from tierserve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    rid: str
    arrival: int  # its place in line, taken when it arrived
    prompt_ids: list[int]
    params: SamplingParams  # as the server resolved it (max_tokens filled in)
    prompt_text: str | None = None  # the prompt as sent, when it was text
    grammar: str | None = None  # the compiled structured output, xgrammar's serialised form
    dp_rank: int = 0  # DP attention: the attention group rank 0 placed it on


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    rid: str


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    pass


class PrepareGrammars(msgspec.Struct, frozen=True, tag=True):
    """A structured output is compiling for this engine: load xgrammar and its view of the
    tokenizer now, beside the loop, rather than inside the step that adds the request."""


# msgspec reads the unions below: no `X | Y` (UP007)
EngineInput = Union[AddRequest, AbortRequest, FlushCache, PrepareGrammars]  # noqa: UP007


class BusMessage(msgspec.Struct, frozen=True):
    """What rank 0 tells the other ranks before each step: the inputs since the last one, and
    whether to step or stop."""

    inputs: list[EngineInput] = []
    step: bool = False
    stop: bool = False


class GroupReport(msgspec.Struct, frozen=True):
    """What an attention group's first rank tells rank 0 after each step under data-parallel
    attention (and after a cache flush): its tokens and its state."""

    dp_rank: int
    outputs: list[StepOutput] = []
    scheduled: int = 0  # requests it ran in the step: 0 when it only joined the collectives
    running: int = 0
    waiting: int = 0
    device_tokens_used: int = 0
    flushed: dict[str, Union[int, str]] | None = None  # noqa: UP007 (after a FlushCache)
    spec: list[int] = []  # its speculation counters so far (SpecStats.counts)


# --- API process -> engine core -----------------------------------------------------------


class GetMetrics(msgspec.Struct, frozen=True, tag=True):
    pass


class Ask(msgspec.Struct, frozen=True, tag=True):
    """A question the core answers between steps, with an `Answer` of the same `ask_id`."""

    ask_id: int
    query: Union[FlushCache, GetMetrics]  # noqa: UP007


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Close the engine (storage writes, the other ranks) and exit 0."""


CoreInput = Union[AddRequest, AbortRequest, PrepareGrammars, Ask, Shutdown]  # noqa: UP007


# --- engine core -> API process -----------------------------------------------------------


class CoreInfo(msgspec.Struct, frozen=True):
    """What the API process needs of the engine to tokenize, validate and describe requests."""

    pid: int
    model_path: str
    tokenizer_path: str
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    num_pages: int  # the device pool, per rank
    page_size: int
    hidden_states_dir: str | None = None  # every request's hidden states go there
    hidden_state_bytes_per_token: int = 0  # what each prompt token takes in its file
    api_cores: tuple[int, ...] = ()  # where the API process runs (): every core; placement.py


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    info: CoreInfo


class CoreRefused(msgspec.Struct, frozen=True, tag=True):
    """The start-up was refused (a flag, a size that does not fit): the server exits 2."""

    message: str
    field: str | None = None


class CoreFailed(msgspec.Struct, frozen=True, tag=True):
    """The loop died of a bug: the server answers 503 and exits 1."""

    message: str


class StepOutputs(msgspec.Struct, frozen=True, tag=True):
    """One step's tokens, and the scheduler's queue as it stands after it (admission)."""

    outputs: list[StepOutput]
    waiting: int
    adds_taken: int  # AddRequests the core has read in all
    # AbortRequests the core has applied in all: no output of a request aborted by one of
    # them follows this message, so the API process may give its id to a new request.
    aborts_taken: int = 0


class RequestFailed(msgspec.Struct, frozen=True, tag=True):
    """An AddRequest the engine refused (an id already in flight): that request's 400."""

    rid: str
    message: str
    field: str | None = None


class MetricFamily(msgspec.Struct, frozen=True):
    """One Prometheus family as the engine reads it: the server renders it unchanged."""

    name: str
    kind: str  # "gauge" | "counter"
    doc: str
    labels: list[str] = []
    samples: list[tuple[list[str], float]] = []  # label values, value


class Answer(msgspec.Struct, frozen=True, tag=True):
    ask_id: int
    tiers: dict[str, Union[int, str]] | None = None  # noqa: UP007 (FlushCache)
    metrics: list[MetricFamily] | None = None  # GetMetrics


CoreOutput = Union[CoreReady, CoreRefused, CoreFailed, StepOutputs, RequestFailed, Answer]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_bus_decoder = msgspec.msgpack.Decoder(BusMessage)
_report_decoder = msgspec.msgpack.Decoder(GroupReport)
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: BusMessage | GroupReport | CoreInput | CoreOutput) -> bytes:
    return _encoder.encode(message)


def decode_report(data: bytes) -> GroupReport:
    return _report_decoder.decode(data)


def decode_bus(data: bytes) -> BusMessage:
    return _bus_decoder.decode(data)


def decode_input(data: bytes) -> CoreInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    return _output_decoder.decode(data)
