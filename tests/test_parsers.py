"""Tool-call and reasoning parsers: one state machine for streamed and whole text, so every
chunking of a reply (a character, a token, random pieces, all of it) parses the same."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import tierserve
from tierserve.frontend.output import IncrementalDetokenizer
from tierserve.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParsedDelta,
    ReplyParser,
    RequiredToolsReply,
    ToolCall,
)

CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": "tool calls </tool_call> inside a string", "n": 3}),
    ("noop", {}),
]


def qwen(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>\n"


def kimi_calls(calls: list[tuple[str, dict]], bad: bool = False) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
        f"{'{oops' if bad and i == 1 else json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def deepseek_calls(calls: list[tuple[str, dict]], v31: bool, bad: bool = False) -> str:
    def one(i: int, name: str, args: dict) -> str:
        text = "{oops" if bad and i == 1 else json.dumps(args)
        if v31:
            return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{text}<｜tool▁call▁end｜>"
        return (
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{text}\n```"
            "<｜tool▁call▁end｜>"
        )

    body = "".join(one(i, n, a) for i, (n, a) in enumerate(calls))
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def written(parser: str, calls: list[tuple[str, dict]], bad: bool = False) -> str:
    """`calls` as the family writes them; with `bad`, the second call's arguments do not read."""
    if parser == "qwen25":
        texts = [qwen(n, a) for n, a in calls]
        if bad and len(texts) > 1:
            texts[1] = '<tool_call>\n{"name": "search", "arguments": {oops}\n</tool_call>\n'
        return "".join(texts)
    if parser == "kimi_k2":
        return kimi_calls(calls, bad)
    return deepseek_calls(calls, parser == "deepseekv31", bad)


def parse(parser: str | None, reasoning: str | None, pieces: list[str], in_think: bool = False):
    tools = TOOL_PARSERS[parser](None, lambda i: f"call_{i}") if parser else None
    reply = ReplyParser(REASONING_PARSERS[reasoning](in_think) if reasoning else None, tools)
    out = ParsedDelta()
    for piece in pieces:
        out += reply.feed(piece)
    out += reply.finish()
    return out, reply.calls


@functools.cache
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(Path(tierserve.__file__).parent / "demo_model")


def token_pieces(text: str) -> list[str]:
    """The text as a server streams it: one detokenized piece per token (a piece may be empty
    while a character's bytes are incomplete)."""
    tokenizer = demo_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in tokenizer(text, add_special_tokens=False).input_ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    return pieces


def chunkings(text: str, cuts: list[int]) -> list[list[str]]:
    """The text whole, a character at a time, a token at a time, and cut at the `cuts`."""
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return [[text], list(text), token_pieces(text), pieces]


def concatenated(out: ParsedDelta) -> dict[int, tuple[str, str, str]]:
    """Each streamed call's id, name and its argument pieces joined."""
    calls: dict[int, list[str]] = {}
    for d in out.tool_calls:
        if d.id is not None:
            assert d.index not in calls, "a call's id and name come once, in its first delta"
            calls[d.index] = [d.id, d.name or "", ""]
        calls[d.index][2] += d.arguments
    return {i: tuple(v) for i, v in calls.items()}  # type: ignore[misc]


FAMILIES = ["qwen25", "kimi_k2", "deepseekv3", "deepseekv31"]
REASONING = {
    "qwen25": "qwen3",
    "kimi_k2": "kimi_k2",
    "deepseekv3": "deepseek-r1",
    "deepseekv31": "deepseek-r1",
}


@pytest.mark.parametrize("parser", FAMILIES)
@pytest.mark.parametrize("count", [0, 1, 3])
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_every_chunking_parses_the_same(parser: str, count: int, cuts: list[int]) -> None:
    calls = CALLS[:count]
    text = "I will look that up.\n" + written(parser, calls)
    whole, whole_calls = parse(parser, None, [text])
    assert whole.content.strip() == "I will look that up."
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    expected_ids = [c.id for c in whole_calls]
    if parser == "kimi_k2":  # Kimi's ids as the model wrote them
        assert expected_ids == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]
    for pieces in chunkings(text, cuts):
        out, got = parse(parser, None, pieces)
        assert out.content == whole.content and got == whole_calls
        assert concatenated(out) == {i: (c.id, c.name, c.arguments) for i, c in enumerate(got)}


@pytest.mark.parametrize("parser", FAMILIES)
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_calls_inside_thinking_are_reasoning(parser: str, cuts: list[int]) -> None:
    inside = written(parser, CALLS[:1])
    text = f"<think>First I plan: {inside} then act.</think>\n\nDone: " + written(parser, CALLS[1:])
    whole, calls = parse(parser, REASONING[parser], [text])
    assert whole.reasoning == f"First I plan: {inside} then act."
    assert whole.content == "Done: "
    assert [c.name for c in calls] == ["search", "noop"]
    for pieces in chunkings(text, cuts):
        out, got = parse(parser, REASONING[parser], pieces)
        assert (out.reasoning, out.content, got) == (whole.reasoning, whole.content, calls)


@pytest.mark.parametrize("parser", FAMILIES)
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_a_malformed_call_is_content_and_spares_the_others(parser: str, cuts: list[int]) -> None:
    text = "Calling. " + written(parser, CALLS, bad=True)
    whole, calls = parse(parser, None, [text])
    assert [c.name for c in calls] == ["get_weather", "noop"]
    assert "{oops" in whole.content and whole.content.startswith("Calling. ")
    for pieces in chunkings(text, cuts):
        out, got = parse(parser, None, pieces)
        assert (out.content, got) == (whole.content, calls)


def test_a_prompt_that_opens_thinking_starts_the_reply_inside_it() -> None:
    parser = REASONING_PARSERS["deepseek-r1"]()
    assert parser.opened_in("<｜Assistant｜><think>\n")
    assert not parser.opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out, _ = parse(None, "deepseek-r1", ["still thinking</think>The answer is 4."], in_think=True)
    assert (out.reasoning, out.content) == ("still thinking", "The answer is 4.")
    unclosed, _ = parse(None, "qwen3", ["<think>never closed"])
    assert (unclosed.reasoning, unclosed.content) == ("never closed", "")
    plain, _ = parse(None, "qwen3", ["no block here <think>x</think>"])
    assert (plain.reasoning, plain.content) == ("", "no block here <think>x</think>")


def test_unknown_names_and_unclosed_calls_come_back_as_content() -> None:
    tools = TOOL_PARSERS["qwen25"](frozenset({"get_weather"}), lambda i: f"call_{i}")
    reply = ReplyParser(None, tools)
    text = qwen("rm_rf", {}) + qwen("get_weather", {"city": "Oslo"}) + '<tool_call>\n{"name'
    out = reply.feed(text)
    out += reply.finish()
    assert reply.calls == [ToolCall("call_0", "get_weather", '{"city": "Oslo"}')]
    assert out.content == qwen("rm_rf", {}).rstrip() + '<tool_call>\n{"name'


@pytest.mark.parametrize("parser", FAMILIES)
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_an_unclosed_call_spares_the_next(parser: str, cuts: list[int]) -> None:
    """A call cut off before its end marker, then a whole one: the first is content, the
    second a call, however the text arrives."""
    whole_call = written(parser, CALLS[:1])
    begin = TOOL_PARSERS[parser].call_begin
    at = whole_call.index(begin)
    text = whole_call[:at] + begin + '{"name": "get_we' + whole_call[at:]
    whole, calls = parse(parser, None, [text])
    assert [c.name for c in calls] == ["get_weather"]
    assert '{"name": "get_we' in whole.content
    for pieces in chunkings(text, cuts):
        out, got = parse(parser, None, pieces)
        assert (out.content, got) == (whole.content, calls)


@pytest.mark.parametrize("one_call", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call_where_no_grammar_does(one_call: bool):
    """With tool_choice auto no grammar holds the model to one call: both came back, in the
    message and in the stream, though the request said parallel_tool_calls false."""
    tools = TOOL_PARSERS["qwen25"](frozenset({"get_weather", "get_time"}), lambda i: f"call_{i}")
    reply = ReplyParser(None, tools, one_call=one_call)
    text = qwen("get_weather", {"city": "Oslo"}) + qwen("get_time", {})
    out = ParsedDelta()
    for i in range(0, len(text), 7):  # streamed in pieces
        out += reply.feed(text[i : i + 7])
    out += reply.finish()
    names = [c.name for c in reply.calls]
    assert names == (["get_weather"] if one_call else ["get_weather", "get_time"])
    assert {d.index for d in out.tool_calls} == ({0} if one_call else {0, 1})
    assert out.content.strip() == ""


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "1e999"])
def test_arguments_that_strict_json_refuses_are_no_call(value: str) -> None:
    """Python's json reads NaN, Infinity and 1e999, and wrote them back into a call's
    arguments, which a client's JSON.parse refuses: such a call is content."""
    tools = TOOL_PARSERS["qwen25"](frozenset({"f"}), lambda i: f"call_{i}")
    reply = ReplyParser(None, tools)
    text = '<tool_call>\n{"name": "f", "arguments": {"a": ' + value + "}}\n</tool_call>\n"
    out = reply.feed(text)
    out += reply.finish()
    assert not reply.calls and value in out.content
    required = RequiredToolsReply(lambda i: f"call_{i}")
    required.feed('[{"name": "f", "parameters": {"a": ' + value + "}}]")
    assert not required.calls and value in required.finish().content


def test_required_without_a_parser_reads_the_json_array() -> None:
    """Each call is read, and streamed, as its object closes."""
    reply = RequiredToolsReply(lambda i: f"call_{i}")
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS])
    out = ParsedDelta()
    for ch in text:
        delta = reply.feed(ch)
        assert not delta or ch == "}"
        out += delta
        assert len(concatenated(out)) == len(reply.calls)
    out += reply.finish()
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == CALLS
    assert len(concatenated(out)) == 3 and not out.content
    cut = RequiredToolsReply()
    cut.feed(text[:10])
    assert cut.finish().content == text[:10] and not cut.calls


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_a_call_array_cut_short_keeps_the_calls_it_completed(cuts: list[int]) -> None:
    """max_tokens cut the array inside its third call: the two before it are calls (they
    were streamed as they closed), the half-written one is dropped, however the text comes."""
    whole = json.dumps([{"name": n, "parameters": a} for n, a in CALLS], separators=(",", ":"))
    text = whole[: whole.index('{"name":"noop"') + 12]
    for pieces in chunkings(text, cuts):
        reply = RequiredToolsReply(lambda i: f"call_{i}")
        out = ParsedDelta()
        for piece in pieces:
            out += reply.feed(piece)
        out += reply.finish()
        assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == CALLS[:2]
        assert concatenated(out) == {
            i: (c.id, c.name, c.arguments) for i, c in enumerate(reply.calls)
        }
        assert not out.content


def test_kimi_ids_written_twice_are_two_ids() -> None:
    """Kimi's ids are the model's (`functions.NAME:INDEX`); a model that writes one twice got
    two calls of one id, which a client cannot answer apart."""
    calls = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"}), ("noop", {})]
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>{json.dumps(a)}"
        "<|tool_call_end|>"
        for n, a in calls
    )
    text = f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    for pieces in ([text], list(text)):
        _, got = parse("kimi_k2", None, pieces)
        assert [c.id for c in got] == ["functions.get_weather:0", "functions.get_weather:1",
                                       "functions.noop:0"]  # fmt: skip


@pytest.mark.parametrize("parser", ["kimi_k2", "deepseekv3", "deepseekv31"])
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_a_section_whose_call_does_not_read_is_content_as_written(parser: str, cuts) -> None:
    """A section holding only a call that does not read (bad JSON, or cut off by the reply's
    end) comes back as the model wrote it, its section's markers too: they were dropped."""
    section = written(parser, CALLS[:1]).replace(json.dumps(CALLS[0][1]), "{oops")
    unclosed = section[: section.index("{oops") + 5]
    for text in (f"Calling. {section} done", f"Calling. {unclosed}"):
        for pieces in chunkings(text, cuts):
            out, got = parse(parser, None, pieces)
            assert (out.content, got) == (text, [])
