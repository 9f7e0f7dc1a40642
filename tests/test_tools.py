"""Tools through the official `openai` client against real servers with the demo model: the
parser-free JSON form (no --tool-call-parser) and a family's own format (--tool-call-parser
qwen25), forced by tool_choice, streamed and whole; bad definitions are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import psutil
import pydantic
import pytest
from transformers import AutoTokenizer

import tierserve
from tests.conftest import Server, eventually, maps_library
from tierserve.chat.fields import ChatTemplateFields
from tierserve.chat.messages import MAX_TOOL_SCHEMA_NODES, SCHEMA_HOLD_ENV, ToolDefinition
from tierserve.chat.template import render
from tierserve.frontend.grammar import MAX_SCHEMA_ENUM_VALUES
from tierserve.server.tools import _calls_schema

DEMO = Path(tierserve.__file__).parent / "demo_model"
# Bounded arguments: the demo model writes no tool format of its own, and a grammar it follows
# must still end (unbounded numbers or strings could run to max_tokens).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    """The demo model with a parser; its tool schema checks wait while `s.schema_hold` exists."""
    flags = ("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
    hold = tmp_path_factory.mktemp("schema") / "hold"
    with Server(DEMO, "--device", "cpu", *flags, env={SCHEMA_HOLD_ENV: str(hold)}) as s:
        s.schema_hold = hold
        yield s


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def calls_of(message) -> list[tuple[str, dict]]:
    """Each call's name and arguments, checked against its tool's schema."""
    out = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def whole_and_streamed(client: openai.OpenAI, **request) -> tuple:
    """The same greedy request whole and through the client's stream helper."""
    request = {
        "model": "demo_model",
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 120,
        **request,
    }
    whole = client.chat.completions.create(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    return whole, streamed


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_forced_calls_without_a_parser_follow_the_schema(demo_server, choice) -> None:
    """vLLM's parser-free form: one call (parallel_tool_calls false) whose arguments validate,
    the same streamed as whole."""
    client = client_of(demo_server)
    whole, streamed = whole_and_streamed(
        client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
    )
    calls = calls_of(whole.message)
    assert len(calls) == 1 and whole.finish_reason == "tool_calls"
    if isinstance(choice, dict):
        assert calls[0][0] == "add"
    assert calls_of(streamed.message) == calls and streamed.finish_reason == "tool_calls"
    assert whole.message.content is None


def test_required_calls_of_tools_whose_parameters_use_defs(demo_server) -> None:
    """Pydantic writes nested models as `$defs` and `#/$defs/...` references: two such tools
    (their definitions named alike) compile under `required`, and the call follows its tool's
    schema. Nested whole in the array of calls, the references did not resolve: a 400."""

    def tool(name: str, maximum: int) -> dict:
        x = {"type": "integer", "minimum": 0, "maximum": maximum}
        point = {"type": "object", "properties": {"x": x}, "required": ["x"],
                 "additionalProperties": False}  # fmt: skip
        parameters = {"type": "object", "$defs": {"Point": point},
                      "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
                      "additionalProperties": False}  # fmt: skip
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    tools = [tool("near", 9), tool("far", 99)]
    reply = client_of(demo_server).chat.completions.create(
        model="demo_model", messages=ASK, temperature=0, max_tokens=60, tools=tools,
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    schema = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


def test_required_calls_are_bounded_and_a_cut_array_keeps_its_calls(demo_server) -> None:
    """`required` with parallel calls allowed (OpenAI's default) and no parser: the array holds
    at most one call per tool, so it ends; unbounded, the demo model wrote calls until
    max_tokens and the reply had none (7 of 7 tries). Cut by max_tokens inside a later call,
    the reply keeps the calls that completed, finish_reason "length", streamed and whole."""
    client = client_of(demo_server)
    lookup = {"type": "function", "function": {"name": "get_weather",
              "parameters": SCHEMAS["get_weather"]}}  # fmt: skip
    whole, streamed = whole_and_streamed(
        client, tools=[lookup], tool_choice="required", max_tokens=96
    )
    assert len(calls_of(whole.message)) == 1 and whole.finish_reason == "tool_calls"
    assert calls_of(streamed.message) == calls_of(whole.message)
    request = {"model": "demo_model", "messages": ASK, "temperature": 0, "tools": TOOLS,
               "tool_choice": "required"}  # fmt: skip
    full = client.chat.completions.create(
        **request, max_tokens=160, extra_body={"return_token_ids": True}
    ).choices[0]
    calls = calls_of(full.message)
    assert 2 <= len(calls) <= len(TOOLS) and full.finish_reason == "tool_calls"
    # max_tokens that end the reply before the last call's object closes
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    ids = full.model_extra["token_ids"]
    closing = tokenizer.decode(ids).rindex("}}")
    cut_at = max(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k])) <= closing)
    whole = client.chat.completions.create(**request, max_tokens=cut_at).choices[0]
    assert whole.finish_reason == "length" and not whole.message.content
    assert calls_of(whole.message) == calls[:-1]
    # The stream helper refuses a "length" reply: the chunks, read here.
    pieces: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**request, max_tokens=cut_at, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            piece = pieces.setdefault(d.index, ["", ""])
            piece[0] += d.function.name or ""
            piece[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    streamed = [(name, json.loads(arguments)) for name, arguments in pieces.values()]
    assert (streamed, finish, content) == (calls[:-1], "length", "")


def test_forced_calls_in_the_family_format_are_parsed(family_server) -> None:
    """With --tool-call-parser qwen25 the grammar writes the family's <tool_call> blocks and
    the parser reads them back; streamed calls accumulate to the whole reply's. Thinking off
    (Qwen3's switch): the grammar starts with the call. The family's structural tag is made in
    the compile workers: the API process never loads xgrammar, nor the torch it brings."""
    client = client_of(family_server)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    for parallel in (True, False):
        whole, streamed = whole_and_streamed(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            extra_body=no_thinking,
        )  # fmt: skip
        calls = calls_of(whole.message)
        assert calls and whole.finish_reason == "tool_calls"
        assert parallel or len(calls) == 1
        assert calls_of(streamed.message) == calls
        assert "<tool_call>" not in (whole.message.content or "")
    text = client.chat.completions.create(
        model="demo_model", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8
    ).choices[0]
    assert text.finish_reason in ("stop", "length")  # auto: the model may answer in text
    assert not maps_library(psutil.Process(family_server.proc.pid), "libtorch")


def test_reasoning_comes_apart_from_content_streamed_and_whole(family_server) -> None:
    """A reply forced (by a regex) to think first: its block in reasoning_content and
    reasoning, the rest in content, the same streamed (reasoning deltas apart) as whole."""
    client = client_of(family_server)
    request = {
        "model": "demo_model", "messages": ASK, "temperature": 0, "max_tokens": 40,
        "extra_body": {"regex": "<think>[a-z ]{3,12}</think>\n\n[a-z ]{2,12}"},
    }  # fmt: skip
    message = client.chat.completions.create(**request).choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert message.model_extra["reasoning"] == reasoning
    assert 3 <= len(reasoning) <= 12 and 2 <= len(content) <= 12 and "<think>" not in content
    thought, said = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert not (delta.content and extra.get("reasoning_content"))  # apart
        thought += extra.get("reasoning_content") or ""
        said += delta.content or ""
    assert (thought, said) == (reasoning, content)


def test_parse_returns_a_strict_pydantic_tools_arguments(demo_server) -> None:
    class Lookup(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        celsius: bool

    tool = openai.pydantic_function_tool(Lookup, name="lookup")
    reply = client_of(demo_server).chat.completions.parse(
        model="demo_model",
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        temperature=0,
        max_tokens=60,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_a_history_with_calls_and_results_is_rendered(demo_server) -> None:
    """Assistant turns with content null and tool_calls, tool results with ids: accepted, and
    the template is given the arguments as an object."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
        "{{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %}\n{% endfor %}"
    )
    url = f"{demo_server.url}/v1/chat/completions"
    reply = httpx.post(url, json={"messages": history, "tools": TOOLS, "tool_choice": "none",
                                  "max_tokens": 4}, timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    body = ChatTemplateFields(messages=history, chat_template=template)
    text = render(tokenizer, body, trust_request_template=True)
    assert "assistant:[call_1 get_weather Paris]" in text
    assert "tool:18 C and sunny<call_1>" in text


BAD = [
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # auto by default, and no parser here
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
    ({"tools": "add"}, "tools"),
    ({"tools": [{}]}, "tools.0"),
    ({"tools": [{"type": "retrieval", "function": ADD["function"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 300}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name"),
    # OpenAI's names only: a quote, backslash, line break or tab never read back as a call
    *(({"tools": [{"type": "function", "function": {"name": f"get{c}weather"}}],
        "tool_choice": "required"}, "tools.0.function.name") for c in '"\\\n\t.'),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                 "parameters": {"type": "object", "required": "a"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                 "parameters": {"type": "object", "properties": {"a": {"minimum": "x"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools.0.function.strict"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages.0"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     "messages.0.tool_calls.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "", "arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "web", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls.0.type"),
    ({"functions": [ADD["function"]]}, "functions"),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools"),  # a name twice
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools"),
]  # fmt: skip


def test_bad_tools_choices_and_histories_are_400s_naming_the_field(demo_server) -> None:
    assert len(BAD) >= 42
    with httpx.Client(base_url=demo_server.url, timeout=60) as http:
        for extra, field in BAD:
            body = {"messages": ASK, "max_tokens": 2, **extra}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, (extra, reply.text)
            error = reply.json()["error"]
            assert field in error["message"] or field == error["param"], (extra, error)
    assert http.is_closed


def properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


def test_tool_schemas_past_the_bound_are_refused_before_they_are_checked(demo_server) -> None:
    """A tool schema past MAX_TOOL_SCHEMA_NODES is a 400 naming it, before jsonschema reads
    it: 150,000 properties (7 MB) had held the event loop, /health too, for 164 s, and one
    just past the bound was checked and served."""
    over = properties(MAX_TOOL_SCHEMA_NODES // 2)  # two values a property, and the root's
    huge = properties(150_000)
    assert len(json.dumps(huge)) > 4_000_000
    with httpx.Client(base_url=demo_server.url, timeout=60) as client:
        for schema in (over, huge):
            tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
            body = {"messages": ASK, "max_tokens": 2, "tools": [tool], "tool_choice": "none"}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "tools" and "tools.0.function.parameters" in error["message"]
        # Each within the bound, together past what one request's tools may hold.
        tools = [
            {"type": "function", "function": {"name": f"f{i}", "parameters": properties(2_400)}}
            for i in range(9)
        ]
        body = {"messages": ASK, "max_tokens": 2, "tools": tools, "tool_choice": "none"}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text


def test_tool_schemas_are_checked_off_the_event_loop(family_server) -> None:
    """A tool schema's check held open (the test's hold, where jsonschema runs): /health and
    another request's stream complete meanwhile; released, the held request is served. On the
    event loop, a schema of 60,000 properties kept /health waiting 17 s."""
    hold, held = family_server.schema_hold, Path(f"{family_server.schema_hold}.held")
    tool = {"type": "function", "function": {"name": "f", "parameters": properties(3)}}
    body = {"messages": ASK, "max_tokens": 2, "tools": [tool], "tool_choice": "none"}
    url = f"{family_server.url}/v1/chat/completions"
    hold.touch()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            checked = pool.submit(httpx.post, url, json=body, timeout=120)
            assert eventually(held.exists, 60), "the schema check never reached the hold"
            with httpx.Client(base_url=family_server.url, timeout=60) as client:
                assert client.get("/health").status_code == 200
                plain = {"prompt": "Once upon", "max_tokens": 4, "stream": True}
                with client.stream("POST", "/v1/completions", json=plain) as stream:
                    assert stream.status_code == 200
                    assert "data: [DONE]" in "".join(stream.iter_text())
            assert not checked.done()  # still held: the stream did not wait for it
            hold.unlink()
            assert checked.result(timeout=120).status_code == 200
    finally:
        hold.unlink(missing_ok=True)
        held.unlink(missing_ok=True)


def test_a_reference_to_the_schema_root_is_the_tools_parameters() -> None:
    """`$ref: "#"` in a tool's parameters means its parameters; nested in the array of calls
    (`required` without a parser) it meant the whole array."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    tree = {"type": "object", "properties": {
        "leaf": {"enum": ["x", "y"]}, "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
        "also": {"$ref": "#/properties/leaf"}}, "required": ["leaf", "next"],
        "additionalProperties": False}  # fmt: skip
    tools = [ToolDefinition.model_validate({"type": "function", "function": {
        "name": n, "parameters": tree}}) for n in ("tree", "other")]  # fmt: skip
    schema = json.dumps(_calls_schema(tools, parallel=True))
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    params = '{"leaf": "x", "next": {"leaf": "y", "next": null, "also": "x"}}'
    assert _is_grammar_accept_string(grammar, f'[{{"name": "tree", "parameters": {params}}}]')
    nested_array = (
        '{"leaf": "x", "next": [{"name": "tree", "parameters": {"leaf": "y", "next": null}}]}'
    )
    assert not _is_grammar_accept_string(
        grammar, f'[{{"name": "tree", "parameters": {nested_array}}}]'
    )


def test_a_family_formats_tools_are_held_to_the_grammar_limits(family_server) -> None:
    """A forced call's tools in the family's format are under the limits every JSON schema is
    (docs/server.md), counted over all of them: 20,000 enum values had compiled for 17-21 s.
    Each tool here is within the bound on a tool schema's size."""
    per_tool = MAX_SCHEMA_ENUM_VALUES // 3 + 1
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"enum": list(range(per_tool))}}}}}
        for i in range(3)]  # fmt: skip
    body = {"messages": ASK, "max_tokens": 2, "tools": tools, "tool_choice": "required"}
    reply = httpx.post(f"{family_server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools" and "enum values" in error["message"], error


def test_a_langchain_agent_round_trip(demo_server, monkeypatch) -> None:
    """LangChain's OpenAI chat model, unmodified, with its forced-tool setting: the call comes
    back as a tool call, and the history it sends with the tool's result is accepted."""
    monkeypatch.setenv("LANGSMITH_TRACING", "false")  # tracing off: nothing leaves the machine
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Number(pydantic.BaseModel):
        a: int = pydantic.Field(ge=0, le=99)  # bounded: the demo model's digits must end

    @tool(args_schema=Number)
    def add(a: int) -> int:
        """Add one to a number."""
        return a + 1

    llm = ChatOpenAI(
        base_url=f"{demo_server.url}/v1", api_key="x", model="demo_model", temperature=0,
        max_tokens=60, max_retries=0,
    )  # fmt: skip
    forced = llm.bind_tools([add], tool_choice="add")
    question = HumanMessage("What is 2 plus 1?")
    ai = forced.invoke([question])
    (call,) = ai.tool_calls
    assert call["name"] == "add" and isinstance(call["args"]["a"], int)
    result = ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"])
    answer = llm.bind_tools([add], tool_choice="none").invoke([question, ai, result])
    assert isinstance(answer.content, str) and not answer.tool_calls


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
LOOKUP_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}}}}'
)
QWEN25_GOLDEN = f"""<|im_start|>system
Be brief.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{LOOKUP_JSON}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18 C
</tool_response><|im_end|>
<|im_start|>assistant
"""
KIMI_K2_GOLDEN = (
    f"<|im_system|>tool_declare<|im_middle|>[{LOOKUP_JSON}]<|im_end|>"
    "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18 C<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>"
)


@pytest.mark.parametrize(
    ("template", "call_id", "golden"),
    [
        ("qwen25_style.jinja", "call_7", QWEN25_GOLDEN),
        ("kimi_k2_style.jinja", "functions.get_weather:0", KIMI_K2_GOLDEN),
    ],
)
def test_family_templates_render_an_openai_history(template, call_id, golden) -> None:
    """An OpenAI-shaped request (string arguments, a tool result with its id, content null)
    rendered by templates written from Qwen2.5's and Kimi-K2's documented formats."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text",
                                     "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C"},
    ]  # fmt: skip
    body = ChatTemplateFields(
        messages=messages, tools=[LOOKUP], chat_template=(TEMPLATES / template).read_text()
    )
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    assert render(tokenizer, body, trust_request_template=True) == golden
