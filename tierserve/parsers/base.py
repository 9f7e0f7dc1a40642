"""What a parser turns model text into, and the one streaming interface every parser has.

Parsers are fed the output text in whatever pieces it arrives (a character, a token, a whole
reply) and return what those pieces settle; `finish` returns the rest. Text that may still begin
a marker is held back until it cannot, so the pieces a stream shows always concatenate to what
the whole text parses to: one state machine serves both, and no chunking changes the result.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeGuard


@dataclass(frozen=True)
class ToolCall:
    """A complete call: `arguments` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries its id and name, later ones only
    argument text; a call's argument pieces concatenate to its `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (and must wait)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def random_call_id(index: int) -> str:
    """OpenAI's shape of a call id; the index is not part of it."""
    return f"call_{uuid.uuid4().hex[:24]}"


def strict_json(text: str) -> Any:
    """`text` read as JSON, as strict parsers read it: Python's json reads NaN, Infinity and
    1e999 (as inf), which it would write back into a call's arguments, and a client's
    JSON.parse refuses. ValueError or RecursionError where it is not JSON."""
    return STRICT_JSON.decode(text)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


STRICT_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one."""
    try:
        value = strict_json(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# A function's name as the formats write it: OpenAI's characters, and dots (namespaces).
# Anything else (a marker, a line break) means the text around it is no call.
NAME = re.compile(r"[\w.\-]+")


def is_name(text: str) -> bool:
    return NAME.fullmatch(text) is not None


def arguments_text(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Body:
    """A call's body as the model wrote it, read: its name, arguments, and own id (Kimi's)."""

    name: str
    arguments: str
    id: str | None = None


class ToolParser(ABC):
    """One reply's tool calls in a family's token format, parsed as the text streams.

    A family writes calls between `call_begin` and `call_end`, optionally inside a section
    (`section_begin` … `section_end`). Text outside calls is content. A call whose body does
    not read (`read_body` returns None: bad JSON, a name not in the request's tools) comes back
    as content, as the model wrote it, its markers with it, and the calls beside it are kept.
    A section in which no call reads is content whole, its own markers too; one that holds a
    call drops them (its unreadable text before that call is held until the call reads)."""

    name: ClassVar[str]
    section_begin: ClassVar[str | None] = None
    section_end: ClassVar[str | None] = None
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    # Special tokens (skipped by default detokenization) that the format is written in.
    needs_special_tokens: ClassVar[bool] = False
    # The xgrammar builtin structural tag of this format (tool_choice required or named).
    structural_tag: ClassVar[str]

    def __init__(
        self,
        tool_names: frozenset[str] | None = None,
        make_id: Callable[[int], str] = random_call_id,
    ) -> None:
        self.tool_names = tool_names  # None: any name reads
        self.make_id = make_id
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._in_section = False
        self._after_call = False  # whitespace right after a call is not content
        self._finishing = False
        # The open section's text (its begin marker first) while no call in it has read.
        self._held: str | None = None

    @abstractmethod
    def read_body(self, body: str) -> Body | None:
        """The call between the markers, or None when it is malformed."""

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            step = self._section() if self._in_section else self._content()
            if step is None:
                return out
            out += step

    def finish(self) -> ParsedDelta:
        """The end of the reply: whatever is held is content (an unclosed call included)."""
        self._finishing = True
        out = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._after_call:
            rest = rest.lstrip()
        if self._unread_text(self._held) or (self._held is not None and rest.strip()):
            rest = f"{self._held}{rest}"  # a section left open, with text and no call read
        self._held = None
        out.content += rest
        return out

    def _content(self) -> ParsedDelta | None:
        buf = self._buffer
        if self._after_call:
            stripped = buf.lstrip()
            if not stripped:
                return None  # wait: whitespace before a next call or the end is dropped
            buf = self._buffer = stripped
            self._after_call = False
        marker = self.section_begin or self.call_begin
        at = buf.find(marker)
        if at < 0:
            keep = held_back(buf, marker)
            cut = len(buf) - keep
            if cut == 0:
                return None
            self._buffer = buf[cut:]
            return ParsedDelta(content=buf[:cut])
        self._buffer = buf[at:]
        if self.section_begin is not None:
            self._buffer = buf[at + len(marker) :]
            self._in_section, self._held = True, marker
        else:
            self._in_section = True  # one call: the section is the call itself
        return ParsedDelta(content=buf[:at])

    def _section(self) -> ParsedDelta | None:
        buf = self._buffer.lstrip() if self.section_begin else self._buffer
        if self._held is not None:
            self._held += self._buffer[: len(self._buffer) - len(buf)]
        self._buffer = buf
        end = self.section_end
        if end is not None and buf.startswith(end):
            self._buffer, self._in_section = buf[len(end) :], False
            held, self._held = self._held, None
            if self._unread_text(held):  # no call read in it: the section was text
                return ParsedDelta(content=held + end)
            self._after_call = True
            return ParsedDelta()
        if not buf.startswith(self.call_begin):
            if not buf or self.call_begin.startswith(buf) or (end and end.startswith(buf)):
                return None  # a marker may still be forming
            return self._unread(self._stray(buf))
        found = self._block(buf)
        if found is None:
            return None
        end, body = found
        self._buffer = buf[end:]
        if self.section_begin is None:
            self._in_section, self._after_call = False, True
        return self._unread(buf[:end]) if body is None else self._call(body)

    def _unread_text(self, held: str | None) -> TypeGuard[str]:
        """Whether a section's held text has more than its begin marker and whitespace (an
        empty section is no content)."""
        return held is not None and bool(held[len(self.section_begin or "") :].strip())

    def _unread(self, text: str) -> ParsedDelta:
        """Text inside a section that is no call: content, or held with the section's."""
        if self._held is None:
            return ParsedDelta(content=text)
        self._held += text
        return ParsedDelta()

    def _block(self, buf: str) -> tuple[int, Body | None] | None:
        """Where the call at the start of `buf` ends and what it reads as (None: malformed),
        or None while that is not known yet. An end marker inside the arguments (a JSON string
        holding `</tool_call>`) does not close the call: the first end marker after which the
        body reads does. A body that reads at none is malformed up to its first end marker
        once the next call or the section's end begins, or the reply ends; one that does not
        read at its first end marker, with another call begun before it, is malformed up to
        that call (an unclosed call spares the next)."""
        first_failed, pos = None, len(self.call_begin)
        while True:
            close = buf.find(self.call_end, pos)
            later = [buf.find(m, pos) for m in (self.call_begin, self.section_end) if m]
            nxt = min((i for i in later if i >= 0), default=-1)
            if first_failed is not None and (close < 0 or 0 <= nxt < close):
                done = nxt >= 0 or self._finishing
                return (first_failed + len(self.call_end), None) if done else None
            if close < 0:
                return None
            body = self.read_body(buf[len(self.call_begin) : close])
            if body is not None and (self.tool_names is None or body.name in self.tool_names):
                return close + len(self.call_end), body
            if first_failed is None and 0 <= nxt < close:
                return nxt, None
            first_failed = close if first_failed is None else first_failed
            pos = close + len(self.call_end)

    def _stray(self, buf: str) -> str:
        """Text inside a section that is no call, up to the next marker."""
        markers = [self.call_begin, *([self.section_end] if self.section_end else [])]
        stops = [i for i in (buf.find(m) for m in markers) if i > 0]
        cut = min(stops) if stops else len(buf) - max(held_back(buf, m) for m in markers)
        self._buffer = buf[cut:]
        return buf[:cut]

    def _call(self, body: Body) -> ParsedDelta:
        index = len(self.calls)
        call_id = body.id or self.make_id(index)
        taken = {c.id for c in self.calls}
        if call_id in taken:  # a model's own id written twice: two calls, two ids
            call_id = self.another_id(body, index, taken)
        call = ToolCall(call_id, body.name, body.arguments)
        self.calls.append(call)
        head = ToolCallDelta(index, call.id, call.name)
        out = ParsedDelta(tool_calls=[head, ToolCallDelta(index, arguments=call.arguments)])
        if self._held is not None:  # the section holds a call: its markers are no content
            out.content, self._held = self._held[len(self.section_begin or "") :], None
        return out

    def another_id(self, body: Body, index: int, taken: set[str]) -> str:
        """An id for call `index` whose own is `taken` already."""
        return random_call_id(index)


class ReasoningParser:
    """A reply's reasoning between `start` and `end` (the `<think>` block of Qwen3, DeepSeek-R1
    and Kimi-K2), apart from its content. A reply whose prompt already opened the block (R1's
    template, Qwen3-thinking's) starts inside it. Only a block that opens the reply counts:
    `<think>` later on is content."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning" if in_reasoning else "opening"
        self._buffer = ""

    def opened_in(self, prompt: str) -> bool:
        """Whether `prompt` leaves a reasoning block open for the reply."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        if self._state == "opening":
            lead = self._buffer.lstrip()
            if lead.startswith(self.start):
                self._buffer, self._state = lead[len(self.start) :], "reasoning"
            elif not lead or self.start.startswith(lead):
                return out  # the reply may still open a block
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._buffer.find(self.end)
            if at < 0:
                cut = len(self._buffer) - held_back(self._buffer, self.end)
                out.reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return out
            out.reasoning = self._buffer[:at]
            self._buffer, self._state = self._buffer[at + len(self.end) :], "after"
        if self._state == "after":  # the blank lines templates put after the block
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return out
            self._state = "content"
        out.content, self._buffer = self._buffer, ""
        return out

    def finish(self) -> ParsedDelta:
        out = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            out.reasoning += rest
        elif self._state != "after":
            out.content += rest
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def add(cls: type[ToolParser]) -> type[ToolParser]:
        for name in names:
            TOOL_PARSERS[name] = cls
        return cls

    return add


def register_reasoning_parser(
    *names: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        for name in names:
            REASONING_PARSERS[name] = cls
        return cls

    return add
