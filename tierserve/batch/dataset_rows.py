"""A regeneration dataset's rows, read as chat messages and written back in their own format.

Two formats, each with its tools:
- OpenAI `messages` ({"role", "content"}): assistant turns may carry `tool_calls` (with
  `content: null`), `tool` turns their `tool_call_id`; the row's `tools` are OpenAI's.
- ShareGPT `conversations` ({"from", "value"}): `human`, `gpt`, `system`, and the tool turns of
  LLaMA-Factory's form: `function_call` (the value a JSON object `{"name", "arguments"}`, or a
  list of them for parallel calls) and `observation` (a tool's result); the row's `tools` a list
  of function definitions (or its JSON text).
ShareGPT calls have no ids: the messages get `call_{turn}_{k}`, and each observation answers the
next call not answered yet.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from tierserve.batch.jsonl import read_json_lines
from tierserve.chat import ChatMessage, ChatRole, first_problem
from tierserve.errors import TierserveError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
}
Call = tuple[str, Any]  # a call's name and its arguments (an object)


@dataclass
class Row:
    id: Any  # as the input gave it (any JSON value), else the row's index
    index: int  # its place among the input's rows
    raw: dict[str, Any]
    sharegpt: bool  # `conversations` with from/value, else OpenAI `messages`

    @property
    def key(self) -> str:
        """What identifies the row on resume: its id as JSON, so 1, "1" and null differ."""
        return id_key(self.id)

    @property
    def turns(self) -> list[dict[str, Any]]:
        return self.raw["conversations" if self.sharegpt else "messages"]

    @functools.cached_property
    def tools(self) -> list[dict[str, Any]] | None:
        """The row's tools in OpenAI's shape (LLaMA-Factory's bare functions wrapped)."""
        tools = self.raw.get("tools")
        if isinstance(tools, str):
            tools = json.loads(tools) if tools.strip() else None
        if not tools:
            return None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be a list of functions")
        return [t if "function" in t else {"type": "function", "function": t} for t in tools]

    def role(self, turn: dict[str, Any]) -> str:
        if not self.sharegpt:
            return turn["role"]
        speaker: str = turn["from"]
        return SHAREGPT_ROLES.get(speaker, speaker)

    def is_assistant(self, turn: dict[str, Any]) -> bool:
        return self.role(turn) == "assistant"

    def calls_in(self, turn: dict[str, Any]) -> list[Call]:
        """The calls an assistant turn made."""
        if not self.sharegpt:
            return [_read_call(c["function"]) for c in turn.get("tool_calls") or []]
        if turn["from"] != "function_call":
            return []
        value = json.loads(turn["value"])
        return [_read_call(c) for c in (value if isinstance(value, list) else [value])]

    def written(self, turn: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        """The turn replaced by a regenerated assistant message, in the row's own format."""
        if not self.sharegpt:
            out = {**turn, "content": message.get("content")}
            out.pop("tool_calls", None)
            for key in ("tool_calls", "reasoning_content"):
                if message.get(key):
                    out[key] = message[key]
            return out
        calls = [_read_call(c["function"]) for c in message.get("tool_calls") or []]
        if not calls:  # a text answer, in a gpt turn
            return {**turn, "from": "gpt", "value": message.get("content") or ""}
        shaped = [{"name": name, "arguments": arguments} for name, arguments in calls]
        value = shaped[0] if len(shaped) == 1 else shaped
        return {**turn, "from": "function_call", "value": json.dumps(value)}


class Transcript:
    """A row's conversation so far as chat messages, built turn by turn."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.messages: list[dict[str, Any]] = []
        self._unanswered: deque[str] = deque()  # ShareGPT: ids of calls no observation answered

    def add(self, turn: dict[str, Any]) -> None:
        """A turn kept as it is (not an assistant's)."""
        row = self.row
        if not row.sharegpt:
            keep = ("role", "content", "tool_call_id", "name")
            self.messages.append({k: turn[k] for k in keep if k in turn})
            return
        message: dict[str, Any] = {"role": row.role(turn), "content": turn["value"]}
        if turn["from"] == "observation":
            message["tool_call_id"] = self._unanswered.popleft() if self._unanswered else "call_0"
        self.messages.append(message)

    def add_reply(self, message: dict[str, Any]) -> None:
        """A regenerated assistant message; ShareGPT's calls get ids for the observations."""
        calls = message.get("tool_calls") or []
        if self.row.sharegpt:
            turn = len(self.messages)
            calls = [{**c, "id": f"call_{turn}_{k}"} for k, c in enumerate(calls)]
            self._unanswered = deque(c["id"] for c in calls)
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if calls:
            reply["tool_calls"] = calls
        self.messages.append(reply)


def id_key(row_id: Any) -> str:
    return json.dumps(row_id, sort_keys=True)


def read_rows(path: Path) -> list[Row]:
    """The input's rows; a row without an `id` takes its index (an int) as its id."""
    rows: list[Row] = []
    seen: dict[str, str] = {}  # id key -> where it first came
    for where, line in read_json_lines(path):
        sharegpt = isinstance(line, dict) and isinstance(line.get("conversations"), list)
        if not sharegpt and not (isinstance(line, dict) and isinstance(line.get("messages"), list)):
            raise TierserveError(f"{where}: needs `conversations` or `messages` (a list)", "input")
        row = Row(line["id"] if "id" in line else len(rows), len(rows), line, sharegpt)
        check_row(row, where)
        if row.key in seen:
            implicit = "" if "id" in line else " (a row without an id takes its index)"
            message = f"{where}: id {row.key} repeats the one at {seen[row.key]}{implicit}"
            raise TierserveError(message, "input")
        seen[row.key] = where
        rows.append(row)
    return rows


def check_row(row: Row, where: str) -> None:
    """Every turn readable: string role and content (an assistant's content may be null when
    it calls tools), calls whose arguments are JSON objects, tools a list."""
    keys = ("from", "value") if row.sharegpt else ("role", "content")
    for turn in row.turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(keys[0]), str):
            raise TierserveError(f"{where}: every turn needs string {keys[0]} and {keys[1]}")
        content = turn.get(keys[1])
        calls = not row.sharegpt and turn.get("tool_calls")
        if not (isinstance(content, str) or (content is None and calls)):
            raise TierserveError(f"{where}: every turn needs string {keys[0]} and {keys[1]}")
        _check_turn(row, turn, where)
        try:
            row.calls_in(turn)
        except (ValueError, KeyError, TypeError, AttributeError):
            message = f"{where}: a tool call needs a name and JSON-object arguments"
            raise TierserveError(message, "input") from None
    try:
        tools = row.tools  # read once here: a bad list is the input's error
    except ValueError:  # JSON's errors are ValueErrors too
        raise TierserveError(f"{where}: tools must be a list of functions", "input") from None
    if not tools and any(row.is_assistant(t) and row.calls_in(t) for t in row.turns):
        # Regenerated without tools, the calls became text and the tool results answered
        # nothing, with the row counted a success.
        message = f"{where}: an assistant turn calls tools, but the row gives no tools"
        raise TierserveError(message, "input")


def _check_turn(row: Row, turn: dict[str, Any], where: str) -> None:
    """A turn the server would refuse, refused here: before the run, not after a round trip
    each, with the rows before it already sent."""
    if row.sharegpt:
        if row.role(turn) not in get_args(ChatRole):
            known = sorted({*SHAREGPT_ROLES, "system"})
            raise TierserveError(f"{where}: from {turn['from']!r} is none of {known}", "input")
        return
    if row.is_assistant(turn):
        return  # replaced by the model's reply: the server never reads it
    try:
        ChatMessage.model_validate(turn)
    except ValidationError as err:
        field, said = first_problem(err)
        raise TierserveError(f"{where}: {field + ': ' if field else ''}{said}", "input") from None


def prefix_order(rows: list[Row]) -> list[Row]:
    """Rows that open with the same turn, one after another (in their first row's place)."""

    def first(row: Row) -> str:
        return json.dumps(row.turns[0], sort_keys=True) if row.turns else ""

    first_seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        first_seen.setdefault(first(row), i)
    return sorted(rows, key=lambda r: first_seen[first(r)])


def _read_call(function: dict[str, Any]) -> Call:
    name, arguments = function["name"], function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError("a call needs a name and an arguments object")
    return name, arguments
