"""Chat requests rendered by the model's chat template, with what a client may not steer.

`chat_template_kwargs` reaches the template as its variables, as in vLLM and SGLang, with two
limits. Keys that are `apply_chat_template`'s own parameters or our top-level fields
(`tokenize`, `conversation`, `tools`, `chat_template`…) are refused with the field to use: they
would change what the server does with the render, not what the template says. Keys the
template never reads are dropped, as vLLM drops them, so a client that always sends
`enable_thinking` works with every model. A request's own template (`chat_template`) runs only
on a server started with `--trust-request-chat-template`: a template is a program, and nothing
bounds the work of one a client wrote. The rendered text is held to the context length × the
characters-per-token rule before it is tokenized (by the caller, as every prompt's text).
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2 import TemplateError, meta

from tierserve.chat.fields import ChatTemplateFields
from tierserve.errors import TierserveError

# apply_chat_template's own parameters, and what a request sets instead (None: the server
# decides it, no request does).
TEMPLATE_PARAMETERS: dict[str, str | None] = {
    "conversation": "messages",
    "messages": "messages",
    "tools": "tools",
    "documents": "documents",
    "chat_template": "chat_template",
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message",
    "tokenize": None,
    "return_dict": None,
    "return_tensors": None,
    "return_assistant_tokens_mask": None,
    "padding": None,
    "truncation": None,
    "max_length": None,
    "tokenizer_kwargs": None,
}


def template_kwargs(kwargs: dict[str, Any] | None, template: str) -> dict[str, Any]:
    """The request's `chat_template_kwargs` that `template` reads; a reserved key is a 400."""
    for key in kwargs or {}:
        if key in TEMPLATE_PARAMETERS:
            instead = TEMPLATE_PARAMETERS[key]
            use = f"use the top-level field {instead!r}" if instead else "tierserve sets it"
            message = f"chat_template_kwargs may not set {key!r}: {use}"
            raise TierserveError(message, "chat_template_kwargs")
    read = variables_read(template)
    return {key: value for key, value in (kwargs or {}).items() if key in read}


@functools.lru_cache(maxsize=16)
def variables_read(template: str) -> frozenset[str]:
    """The names a template reads from its context (jinja2's own analysis of the source)."""
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except TemplateError:  # it fails at render time too, with the template's own message
        return frozenset()


def model_template(tokenizer: Any) -> str:
    """The checkpoint's chat template; a dict of named ones renders its default."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        raise TierserveError("this model has no chat template; use /v1/completions", "messages")
    return template


def render(tokenizer: Any, body: ChatTemplateFields, trust_request_template: bool) -> str:
    """The prompt text of a chat request (its length is the caller's to bound)."""
    template = model_template(tokenizer)
    if body.chat_template is not None:
        if not trust_request_template:
            message = (
                "a request's own chat_template runs only on a server started with "
                "--trust-request-chat-template"
            )
            raise TierserveError(message, "chat_template")
        template = body.chat_template
    switches = body.template_switches()
    extra = template_kwargs(body.chat_template_kwargs, template)
    messages = [m.for_template() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **extra, **switches
        )
    except (TemplateError, ValueError, TypeError) as err:  # alternating roles; nothing to continue
        message = f"the chat template rejected the messages: {err}"
        raise TierserveError(message, "messages") from None
    except Exception as err:  # a template is code: 1/0, endless recursion, ...
        message = f"the chat template failed on the messages: {type(err).__name__}: {err}"
        raise TierserveError(message, "messages") from None
    if not isinstance(text, str):
        raise TierserveError("the chat template did not render text", "chat_template")
    return text
