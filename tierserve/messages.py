"""What reaches the engine: one typed message set, for the server's inbox and the
tensor-parallel bus alike, with one compact encoding (msgpack, through msgspec).

The server tokenizes and validates a request (`Engine.prepare`), then sends an `AddRequest`;
the engine builds its scheduler state from it. Rank 0 forwards the same messages to the other
ranks, so every rank builds the same state from the same bytes. Nothing here is pickled, so the
engine can move to a process of its own and only the transport changes.
"""

from __future__ import annotations

from typing import Union

import msgspec

from tierserve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    rid: str
    arrival: int  # its place in line, taken when it arrived
    prompt_ids: list[int]
    params: SamplingParams  # as the server resolved it (max_tokens filled in)
    prompt_text: str | None = None  # the prompt as sent, when it was text
    grammar: str | None = None  # the compiled structured output, xgrammar's serialised form


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    rid: str


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    pass


EngineInput = Union[AddRequest, AbortRequest, FlushCache]  # noqa: UP007 (msgspec reads it)


class BusMessage(msgspec.Struct, frozen=True):
    """What rank 0 tells the other ranks before each step: the inputs since the last one, and
    whether to step or stop."""

    inputs: list[EngineInput] = []
    step: bool = False
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_bus_decoder = msgspec.msgpack.Decoder(BusMessage)


def encode(message: BusMessage) -> bytes:
    return _encoder.encode(message)


def decode_bus(data: bytes) -> BusMessage:
    return _bus_decoder.decode(data)
