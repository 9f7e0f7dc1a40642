"""What a chat request carries besides sampling: its messages (text parts, an assistant's
calls, a tool's results), the tools it offers and the tool it may force."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

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
    """OpenAI's function tool: what the model may call and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as err:
            raise ValueError(f"not a JSON schema: {err.message}") from None
        if schema.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON object's schema")
        return schema


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
