"""Chat messages, the fields a chat template renders, and the rendering (jinja2, the model's
template): one reading of a conversation for the server's chat routes and the offline
`LLM.chat`."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
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
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
