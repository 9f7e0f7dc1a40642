"""A chat request's fields that the chat template renders, and the Unicode check every request
body makes: what the server's chat routes and the offline `LLM.chat` read alike."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictBool, ValidationError, model_validator

from tierserve.chat.messages import ChatMessage, ToolDefinition, check_tool_schemas
from tierserve.errors import TierserveError


def _lone_surrogate(value: Any) -> bool:
    """Whether any string in `value` (nested lists and dicts too) cannot be UTF-8: JSON lets a
    client send a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or response can carry.
    A loop, not recursion: no nesting can run it out of stack."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            todo += item.keys()
            todo += item.values()
        elif isinstance(item, list):
            todo += item
    return False


class TextBody(BaseModel):
    """A request body whose strings are all valid Unicode, checked before anything reads them."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _lone_surrogate(data):
            raise ValueError("strings must be valid Unicode (a lone UTF-16 surrogate was sent)")
        return data


class ChatTemplateFields(TextBody):
    """What a chat template renders: the messages, the tools and documents it may show, and
    vLLM's switches (chat/template.py renders them)."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat template switches: open an assistant turn (the default), or continue the
    # last message as it stands (what regenerating a conversation's turn needs).
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: needs --trust-request-chat-template
    tools: list[ToolDefinition] | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: for retrieval templates

    def template_switches(self) -> dict[str, Any]:
        if self.continue_final_message and self.add_generation_prompt:
            message = (
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt false (as in vLLM)"
            )
            raise TierserveError(message, "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            message = "continue_final_message needs an assistant message last"
            raise TierserveError(message, "continue_final_message")
        check_tool_schemas(self.tools)  # once: the server's chat route has checked them already
        extra: dict[str, Any] = {}
        if self.tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.documents:
            extra["documents"] = self.documents
        return {
            **extra,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


def first_problem(err: ValidationError) -> tuple[str, str]:
    """The first thing pydantic refused: where (a dotted path; "" for the whole) and why."""
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return where, first["msg"].removeprefix("Value error, ")
