"""Chat messages, the fields a chat template renders, and the rendering (jinja2, the model's
template): one reading of a conversation for the server's chat routes and the offline
`LLM.chat`."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.chat.fields import ChatTemplateFields, TextBody, first_problem
    from tierserve.chat.messages import (
        ChatMessage,
        ChatRole,
        NamedToolChoice,
        ToolDefinition,
        check_tool_schemas,
    )
    from tierserve.chat.template import render

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "ChatMessage": "messages",
    "ChatRole": "messages",
    "ChatTemplateFields": "fields",
    "NamedToolChoice": "messages",
    "TextBody": "fields",
    "ToolDefinition": "messages",
    "first_problem": "fields",
    "check_tool_schemas": "messages",
    "render": "template",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
