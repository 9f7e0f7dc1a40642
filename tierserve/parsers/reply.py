"""One reply's text split into reasoning, content and tool calls as it streams: the reasoning
parser sees the text first (a call written while thinking is reasoning), the tool parser sees
what it leaves as content."""

from __future__ import annotations

from collections.abc import Callable

from tierserve.parsers.base import (
    STRICT_JSON,
    ParsedDelta,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    arguments_text,
    random_call_id,
)


class ReplyParser:
    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, one_call: bool = False
    ) -> None:
        # `one_call`: `parallel_tool_calls: false` where no grammar holds the model to one
        # call (tool_choice auto): the calls after the first are dropped, as vLLM does.
        self.reasoning, self.tools, self.one_call = reasoning, tools, one_call

    @property
    def calls(self) -> list[ToolCall]:
        calls = self.tools.calls if self.tools is not None else []
        return calls[:1] if self.one_call else calls

    def feed(self, text: str) -> ParsedDelta:
        return self._through(self.reasoning.feed(text) if self.reasoning else ParsedDelta(text))

    def finish(self) -> ParsedDelta:
        out = self._through(self.reasoning.finish() if self.reasoning else ParsedDelta())
        if self.tools is not None:
            out += self._first_call_only(self.tools.finish())
        return out

    def _through(self, delta: ParsedDelta) -> ParsedDelta:
        if self.tools is None or not delta.content:
            return delta
        calls = self._first_call_only(self.tools.feed(delta.content))
        calls.reasoning = delta.reasoning
        return calls

    def _first_call_only(self, delta: ParsedDelta) -> ParsedDelta:
        if self.one_call:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        return delta


class NamedToolReply:
    """`tool_choice` naming a function, on a server without a parser (vLLM's parser-free form):
    the grammar makes the whole reply that function's arguments, streamed as they come."""

    def __init__(self, name: str, make_id: Callable[[int], str] = random_call_id) -> None:
        self.call_id, self.name = make_id(0), name
        self._arguments: list[str] = []
        self._started = False

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.call_id, self.name, "".join(self._arguments))]

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, self.call_id, self.name))
        if text:
            self._arguments.append(text)
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        return self.feed("")


class RequiredToolsReply:
    """`tool_choice: required` without a parser (vLLM's parser-free form): the grammar makes
    the reply a JSON array of `{"name", "parameters"}`. Each call is read, and streamed, as its
    object closes; a reply cut short (max_tokens) keeps the calls it completed. A reply with no
    complete call is content."""

    def __init__(self, make_id: Callable[[int], str] = random_call_id) -> None:
        self.make_id = make_id
        self.calls: list[ToolCall] = []
        self._text = ""
        self._next = 0  # where the next call may start: after `[` or a call and its `,`
        self._bad = False  # text that is no array of calls: the whole reply is content

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        # An object can only close at a `}`: the reply's text is read again only when one came.
        while not self._bad and "}" in text:
            delta = self._read_call()
            if delta is None:
                break
            out += delta
        return out

    def finish(self) -> ParsedDelta:
        # Calls streamed stay calls; the rest of a cut reply (a call half written) is dropped.
        return ParsedDelta() if self.calls else ParsedDelta(content=self._text)

    def _read_call(self) -> ParsedDelta | None:
        """The next call, if its object has closed (None while it has not)."""
        text, at = self._text, self._next
        if at == 0:
            start = len(text) - len(text.lstrip())
            if not text[start:].startswith("["):
                self._bad = bool(text.strip())
                return None
            at = start + 1
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, end = STRICT_JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None  # not closed yet (the grammar allows only calls here)
        if not _is_call(item):
            self._bad = True
            return None
        index = len(self.calls)
        call = ToolCall(self.make_id(index), item["name"], arguments_text(item["parameters"]))
        self.calls.append(call)
        self._next = end
        return ParsedDelta(tool_calls=[
            ToolCallDelta(index, call.id, call.name),
            ToolCallDelta(index, arguments=call.arguments),
        ])  # fmt: skip


def _is_call(item: object) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and isinstance(item.get("parameters"), dict)
    )
