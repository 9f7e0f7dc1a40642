"""What a chat request carries besides sampling: its messages (text parts, an assistant's
calls, a tool's results), the tools it offers and the tool it may force."""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    field_validator,
    model_validator,
)

from tierserve.errors import TierserveError
from tierserve.utils import wait_while_held

# What a request's tool schemas may be, counted by a walk that costs ~1 ms per 5,000 nodes (each
# dict, list and value is one node; the walk stops at the limit), before jsonschema's
# check_schema reads them: its metaschema check costs up to ~200 us a node (a subschema of `{}`
# or `true` per node, the worst shape measured; `{"type": "string"}` properties ~90 us, enum
# values ~0.3 us), and it compiles each `pattern` (python's re: ~3 us a character of "(a|b)"
# repeated). Measured here (process time, jsonschema 4.26, Draft 2020-12): 8,000 `{}` subschemas
# 1.31-1.44 s, 2,000 0.33-0.40 s; 16,000 `{"type": "string"}` properties 2.98 s; a 1,000,000-
# character pattern 3.26 s. So one schema of up to 5,000 nodes checks in at most ~1 CPU-second,
# and a request's tools together (OpenAI's 128 tools of ~300 values each) in at most ~8, off
# the event loop. Past these a request is a 400 at once: 150,000 properties had held the event
# loop (/health too) for 164 s.
MAX_TOOL_SCHEMA_NODES = 5_000
MAX_TOOLS_SCHEMA_NODES = 8 * MAX_TOOL_SCHEMA_NODES  # all of a request's tools together
MAX_TOOL_PATTERN_CHARS = 100_000  # the regular expressions of one schema, together
# OpenAI's tool names. A name is pasted into grammars and formats as it is: a quote, backslash
# or line break in it made a call that never read back.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
# Tests hold a tool schema's check through this file: while it exists, the check waits, after
# writing FILE.held. Read only when the variable is set.
SCHEMA_HOLD_ENV = "TIERSERVE_TEST_SCHEMA_HOLD"

ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class ContentPart(BaseModel):
    """An OpenAI content part: text only (an image or audio part is refused, as vLLM refuses
    one for a model without that modality), its text a string."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Any = None

    @model_validator(mode="after")
    def _text_is_a_string(self) -> ContentPart:
        if self.type != "text":  # an image or audio the model would never see
            raise ValueError(f"content parts of type {self.type!r} are not supported: the "
                             "models tierserve serves read text")  # fmt: skip
        if not isinstance(self.text, str):
            raise ValueError("a text content part needs a string 'text'")
        return self


class CalledFunction(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    # OpenAI sends a JSON object's text; templates read an object (the render parses it).
    arguments: str | dict[str, Any]

    def arguments_object(self) -> dict[str, Any]:
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object's text")
        return value


class MessageToolCall(BaseModel):
    """An assistant turn's call in a history, as OpenAI's replies give it."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    @model_validator(mode="after")
    def _arguments_read(self) -> MessageToolCall:
        self.function.arguments = self.function.arguments_object()
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's reasoning, as replies give it

    @model_validator(mode="after")
    def _roles_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, calls with their arguments
        as objects, the id a tool result answers."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(BaseModel):
    """OpenAI's function tool: what the model may call and the JSON schema of its arguments.
    Its schema's size is checked as it is read; whether it is a JSON schema, by
    `check_tool_schemas`, off the event loop (jsonschema's check takes up to a second)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None
    _checked: bool = PrivateAttr(default=False)

    @field_validator("parameters")
    @classmethod
    def _an_objects_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        nodes, pattern_chars = schema_size(schema)
        if nodes > MAX_TOOL_SCHEMA_NODES:
            message = (
                f"a tool's parameters may hold {MAX_TOOL_SCHEMA_NODES:,} JSON values (objects, "
                "arrays and values), and these hold more"
            )
            raise ValueError(message)
        if pattern_chars > MAX_TOOL_PATTERN_CHARS:
            message = f"a tool's patterns may run to {MAX_TOOL_PATTERN_CHARS:,} characters"
            raise ValueError(f"{message}, and these run to {pattern_chars:,}")
        if schema.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON object's schema")
        return schema

    def check_schema(self, field: str) -> None:
        """A TierserveError naming `field` unless the parameters are a JSON schema (once)."""
        if self._checked or self.parameters is None:
            return
        import jsonschema

        _test_hold()
        try:
            jsonschema.Draft202012Validator.check_schema(self.parameters)
        except jsonschema.SchemaError as err:
            raise TierserveError(f"{field}: not a JSON schema: {err.message}", field) from None
        except RecursionError:  # nesting the server's body limit refuses; offline, its error
            raise TierserveError(f"{field}: nests too deeply to check", field) from None
        self._checked = True


def schema_size(schema: Any) -> tuple[int, int]:
    """How many JSON values a schema holds (stopping once past MAX_TOOL_SCHEMA_NODES), and the
    characters of its regular expressions (`pattern`, `patternProperties`' keys), which
    check_schema compiles. A loop: no nesting runs it out of stack."""
    nodes, chars, todo = 0, 0, [schema]
    while todo and nodes <= MAX_TOOL_SCHEMA_NODES:
        item = todo.pop()
        nodes += 1
        if isinstance(item, dict):
            pattern = item.get("pattern")
            chars += len(pattern) if isinstance(pattern, str) else 0
            by_pattern = item.get("patternProperties")
            chars += sum(map(len, by_pattern)) if isinstance(by_pattern, dict) else 0
            todo += item.values()
        elif isinstance(item, list):
            todo += item
    return nodes, chars


def check_tool_schemas(tools: list[ToolDefinition] | None) -> None:
    """Each tool's parameters checked as a JSON schema (a TierserveError naming the tool's
    `parameters`); a request's tools past MAX_TOOLS_SCHEMA_NODES together are refused first.
    Seconds of work: the server runs it in a thread."""
    tools = tools or []
    total = sum(schema_size(t.function.parameters)[0] for t in tools if t.function.parameters)
    if total > MAX_TOOLS_SCHEMA_NODES:
        message = (
            f"tools: their parameters may hold {MAX_TOOLS_SCHEMA_NODES:,} JSON values together, "
            f"and these hold {total:,}"
        )
        raise TierserveError(message, "tools")
    for i, tool in enumerate(tools):
        tool.function.check_schema(f"tools.{i}.function.parameters")


def _test_hold() -> None:
    hold = os.environ.get(SCHEMA_HOLD_ENV)
    wait_while_held(hold, f"{hold}.held")


class ToolDefinition(BaseModel):
    """One entry of a chat request's `tools` (OpenAI's shape; the only type is a function)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction
