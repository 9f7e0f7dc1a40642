"""What a chat request's `tools` and `tool_choice` do on this server, and how its replies read.

- `none`: the tools reach the chat template; the reply is text.
- `auto` (the default with tools): the model chooses; its calls are read by the server's
  `--tool-call-parser`. Without one, a 400 naming the flags (as vLLM).
- `required` and a named function: generation is constrained. With a parser, in the family's
  own format (xgrammar's builtin structural tag for it); without one, in vLLM's parser-free
  JSON form: a JSON array of `{"name", "parameters"}` for `required` (at most one call per
  tool), the function's arguments object for a named one.
`parallel_tool_calls: false` allows one call: by the grammar where there is one, else (`auto`)
by keeping the first call the model wrote. With `--reasoning-parser`, the reply's reasoning
is read first; a call written while thinking is reasoning text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from tierserve.chat import NamedToolChoice, ToolDefinition
from tierserve.errors import TierserveError
from tierserve.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    NamedToolReply,
    ParsedDelta,
    ReplyParser,
    RequiredToolsReply,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from tierserve.sampling_params import SamplingParams, StructuredOutput
from tierserve.server.protocol import ChatCompletionRequest

# The formats whose markers xgrammar can match as tokens (its `token_markers`), and the markers.
TOKEN_MARKERS = {"qwen_3": ("<think>", "</think>", "<tool_call>", "</tool_call>")}


class Reply(Protocol):
    @property
    def calls(self) -> list[ToolCall]: ...

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


@dataclass(frozen=True)
class ChatParsers:
    """The server's `--tool-call-parser` and `--reasoning-parser`."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name, known, flag in (
            (self.tool_call_parser, TOOL_PARSERS, "tool_call_parser"),
            (self.reasoning_parser, REASONING_PARSERS, "reasoning_parser"),
        ):
            if name is not None and name not in known:
                message = f"{flag} must be one of {', '.join(sorted(known))}, got {name!r}"
                raise TierserveError(message, flag)


@dataclass(frozen=True)
class ReplyPlan:
    """How one chat request's replies are generated and read."""

    grammar: StructuredOutput | None
    skip_special_tokens: bool
    make_reply: Callable[[str], Reply] | None  # from the rendered prompt; None: plain text


def plan(body: ChatCompletionRequest, parsers: ChatParsers, tokenizer: Any) -> ReplyPlan:
    """The request's reply plan; a tool choice that cannot be honoured is a 400 naming it."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    reasoning = REASONING_PARSERS.get(parsers.reasoning_parser or "")
    family = TOOL_PARSERS.get(parsers.tool_call_parser or "")
    names = frozenset(t.function.name for t in tools)
    if len(names) < len(tools):
        seen = [t.function.name for t in tools]
        repeated = next(n for i, n in enumerate(seen) if n in seen[:i])
        message = f"tools name {repeated!r} twice: a call could not say which it means"
        raise TierserveError(message, "tools")
    if choice != "none" and not tools:
        raise TierserveError(f"tool_choice {_shown(choice)} needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        message = f"tool_choice names {choice.function.name!r}, which is not in tools"
        raise TierserveError(message, "tool_choice")
    if choice == "auto" and family is None:
        message = (
            'tool_choice "auto" needs a tool-call parser: start the server with '
            "--tool-call-parser (vLLM: --enable-auto-tool-choice --tool-call-parser), or "
            'send tool_choice "required", "none" or a named function'
        )
        raise TierserveError(message, "tool_choice")

    def thinking(prompt: str) -> Any:
        return reasoning(reasoning().opened_in(prompt)) if reasoning else None

    if choice == "none":
        make = (lambda prompt: ReplyParser(thinking(prompt), None)) if reasoning else None
        return ReplyPlan(None, True, make)
    if family is not None:
        grammar = None if choice == "auto" else _family_grammar(body, family, reasoning, tokenizer)
        return ReplyPlan(
            grammar,
            not family.needs_special_tokens,
            lambda prompt: ReplyParser(
                thinking(prompt), family(names), one_call=not body.parallel_tool_calls
            ),
        )
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        grammar = StructuredOutput.json(_parameters(tool))
        name = tool.function.name
        return ReplyPlan(grammar, True, lambda prompt: NamedToolReply(name))
    grammar = StructuredOutput.json(_calls_schema(tools, body.parallel_tool_calls))
    return ReplyPlan(grammar, True, lambda prompt: RequiredToolsReply())


@contextlib.contextmanager
def grammar_errors_name_tools(reply: ReplyPlan) -> Iterator[None]:
    """A grammar made from the tools that does not compile (a `$ref` to nowhere, a compile
    past its time) is the tools' error: the 400 names them, not a grammar the client never
    sent."""
    try:
        yield
    except TierserveError as err:
        if reply.grammar is None or err.field != reply.grammar.kind:
            raise
        raise TierserveError(f"tools: {err.message}", "tools") from None


def constrained(params: SamplingParams, reply: ReplyPlan) -> SamplingParams:
    """The request's sampling with its reply plan's grammar and detokenization."""
    if reply.grammar is not None:
        if params.structured_output is not None:
            message = "tool_choice required or named constrains the reply: give no other grammar"
            raise TierserveError(message, "tool_choice")
        params = dataclasses.replace(params, structured_output=reply.grammar)
    if not reply.skip_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _shown(choice: object) -> str:
    return json.dumps(choice) if isinstance(choice, str) else "naming a function"


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def _calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """vLLM's parser-free form of `required`: an array of one call or more, each naming a tool
    and giving its parameters. At most one call when calls may not run in parallel, else at
    most one per tool: unbounded, a small model wrote calls until max_tokens cut the array, and
    the reply had none."""
    defs: dict[str, Any] = {}
    one_of = []
    for i, t in enumerate(tools):
        parameters = _lift_defs(_parameters(t), f"tool{i}", defs)
        one_of.append({
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    most = len(tools) if parallel else 1
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": one_of}
    }  # fmt: skip
    if defs:
        schema["$defs"] = defs
    return schema


DEFS_KEYS = ("$defs", "definitions")  # JSON Schema's, and draft 7's


def _lift_defs(parameters: dict[str, Any], name: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters nested in the array of calls: its definitions move to the root's
    `$defs` under `NAME_` (two tools may name theirs alike), its `#/$defs/...` references with
    them; nested as they were, they resolved against the array and did not compile. A
    reference to the rest of its own schema (`#`, `#/properties/...`) resolved against the
    array too: the parameters then move to `$defs/NAME`, and such references with them."""
    prefix = f"{name}_"
    rooted = False

    def moved(node: Any) -> Any:
        nonlocal rooted
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = out.get("$ref")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return out  # not a reference into this schema
        key = next((k for k in DEFS_KEYS if ref.startswith(f"#/{k}/")), None)
        if key is not None:
            out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3 :]}"
        else:
            out["$ref"] = f"#/$defs/{name}{ref[1:]}"
            rooted = True
        return out

    lifted = moved(parameters)
    for key in DEFS_KEYS:
        block = lifted.pop(key, None)
        for def_name, definition in block.items() if isinstance(block, dict) else ():
            defs[f"{prefix}{def_name}"] = definition
    if not rooted:
        return lifted
    defs[name] = lifted  # `tool0` beside its definitions' `tool0_...`: no name is both
    return {"$ref": f"#/$defs/{name}"}


def _family_grammar(
    body: ChatCompletionRequest, family: type[ToolParser], reasoning: Any, tokenizer: Any
) -> StructuredOutput:
    """The family's own format for `required` or a named function: xgrammar's builtin
    structural tag, which knows each format's markers, made by the compile (in the compile
    pool's processes: xgrammar brings torch). Where xgrammar can match the markers as their
    own tokens and this tokenizer has them, it does: the model cannot spell a marker out of
    pieces. Tools it cannot make a tag of fail that compile: a 400 naming the tools."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    tool_choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    markers = TOKEN_MARKERS.get(family.structural_tag, ())
    token_markers = bool(markers) and all(_one_token(tokenizer, m) for m in markers)
    arguments = {
        "model": family.structural_tag,
        "tools": tools,
        "tool_choice": tool_choice,
        "reasoning": "auto" if reasoning and _thinking_on(body) else "disabled",
        "parallel_tool_calls": body.parallel_tool_calls,
        "token_markers": token_markers,
        "max_whitespace_cnt": 1,  # as our JSON: a small model fills unbounded whitespace
    }
    return StructuredOutput("builtin_structural_tag", json.dumps(arguments, sort_keys=True))


def _thinking_on(body: ChatCompletionRequest) -> bool:
    """Whether the request lets the model think: off with Qwen3's `enable_thinking: false` or
    DeepSeek-V3.1's and Kimi's `thinking: false` in `chat_template_kwargs`."""
    kwargs = body.chat_template_kwargs or {}
    return kwargs.get("enable_thinking") is not False and kwargs.get("thinking") is not False


def _one_token(tokenizer: Any, text: str) -> bool:
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1


def message(reply: Reply, delta: ParsedDelta) -> dict[str, Any]:
    """A whole reply's message fields: content, reasoning (under SGLang's and vLLM's names),
    calls in OpenAI's shape."""
    body: dict[str, Any] = {"role": "assistant", "content": delta.content or None}
    if delta.reasoning:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning
    if reply.calls:
        body["tool_calls"] = [_call(c) for c in reply.calls]
    return body


def delta_fields(delta: ParsedDelta) -> dict[str, Any]:
    """A streamed chunk's delta fields for what this piece of the reply settled."""
    body: dict[str, Any] = {}
    if delta.content:
        body["content"] = delta.content
    if delta.reasoning:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning
    if delta.tool_calls:
        body["tool_calls"] = [_call_delta(d) for d in delta.tool_calls]
    return body


def finish_reason(reply: Reply, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after calling."""
    return "tool_calls" if reply.calls and reason == "stop" else reason


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    """A call's first piece carries its index, id and name; later ones argument text."""
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    function = {"name": d.name, "arguments": d.arguments}
    return {"index": d.index, "id": d.id, "type": "function", "function": function}


def _call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}
