"""Structured output through xgrammar: sampled outputs of the demo model (temperature 1) all
follow their JSON schema or regex; OpenAI's response_format and SGLang's regex / ebnf /
json_schema through a real server with the official client, streamed and not; a grammar that
does not compile is a 400 with the field's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

import tierserve
from tests.conftest import http
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.sampling_params import StructuredOutput

DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "city": {"type": ["string", "null"], "maxLength": 12},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
CODE = r"[a-z]{2,5}-[0-9]{3}( (ok|fail))?"


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(str(DEMO_DIR))


def sampled(llm: LLM, prompt: str, spec: StructuredOutput, n: int, max_tokens: int) -> list:
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured_output=spec)
        for s in range(n)
    ]
    return llm.generate([prompt] * n, params)


def test_hundred_sampled_json_outputs_follow_their_schema(demo):
    outs = sampled(demo, "the king said", StructuredOutput.json(PERSON), 100, 160)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({out.text for out in outs}) > 50  # sampled, not one forced string


def test_hundred_sampled_regex_outputs_match(demo):
    outs = sampled(demo, "the code is", StructuredOutput("regex", CODE), 100, 40)
    assert all(re.fullmatch(CODE, out.text) for out in outs), [o.text for o in outs]
    assert all(out.finish_reason == "stop" for out in outs)
    assert len({out.text for out in outs}) > 50


def test_the_grammar_ends_the_request_even_against_min_tokens(demo):
    """min_tokens holds the stop token back, but a grammar that is complete allows nothing
    else: the grammar wins."""
    spec = StructuredOutput("regex", "yes|no")
    params = SamplingParams(max_tokens=20, min_tokens=10, structured_output=spec)
    out = demo.generate("well", params)
    assert out[0].text in ("yes", "no") and out[0].finish_reason == "stop"


def test_a_bounded_json_string_refuses_raw_control_characters(demo):
    """xgrammar lets them into strings with a maxLength; tierserve's grammar does not, so
    json.loads never meets one."""
    tokenizer = demo.tokenizer
    quote, letter = (tokenizer.convert_tokens_to_ids(t) for t in ('"', "a"))
    control = tokenizer.convert_tokens_to_ids("Ė")  # the byte-level token of byte 0x16
    state = demo.engine.grammars.start(StructuredOutput.json({"type": "string", "maxLength": 5}))
    state.accept(quote)
    row = torch.zeros(demo.engine.model_config.vocab_size)
    state.mask(row)
    assert row[letter] == 0 and row[control] == float("-inf")


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput.json({"type": "string", "maxLength": 5}),
        StructuredOutput.json({"type": "string"}),
        StructuredOutput("json_object", ""),
    ],
    ids=["bounded string", "string", "json_object"],
)
def test_a_json_string_refuses_the_utf8_bytes_of_a_surrogate(demo, spec):
    """xgrammar lets a UTF-16 surrogate's UTF-8 bytes (ED A0-BF xx) into JSON strings; no
    decoder takes them (the text gets three U+FFFD, a maxLength is broken). After an ED byte,
    tierserve's grammar allows the continuations of U+D000-U+D7FF only."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = {b: demo.tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    assert len(set(byte.values())) == 256  # a byte-level vocabulary: a token per byte
    state = demo.engine.grammars.start(spec)
    opening = b'{"' if spec.kind == "json_object" else b'"'
    assert all(state.try_accept(byte[b]) for b in opening + b"\xed")
    row = torch.zeros(demo.engine.model_config.vocab_size)
    state.mask(row)
    assert row[byte[0x80]] == 0 and row[byte[0x9F]] == 0
    assert row[byte[0xA0]] == float("-inf") and row[byte[0xBF]] == float("-inf")


def test_json_object_is_an_object_without_runs_of_whitespace(demo):
    """OpenAI's json_object promises an object, and tierserve's JSON is compact: xgrammar's
    builtin JSON grammar let an array start the reply and runs of whitespace anywhere (the
    demo model wrote `[             1, 2, ...`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = {b: demo.tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    grammars = demo.engine.grammars
    compiled = grammars.compile(StructuredOutput("json_object"))
    state = grammars.matcher(compiled)
    assert not state.try_accept(byte[ord("[")]) and not state.try_accept(byte[ord(" ")])
    for prefix, then in ((b'{"a": ', b"2"), (b'{"a": 1, ', b'"'), (b'{"a": [1, ', b"2")):
        state = grammars.matcher(compiled)
        assert all(state.try_accept(byte[b]) for b in prefix), prefix
        assert not state.try_accept(byte[ord(" ")]), prefix  # a second space: a run
        assert state.try_accept(byte[then[0]]), prefix


def test_json_object_replies_that_stop_are_objects(demo_server):
    """Sixteen sampled replies (one request, n=16): those the grammar ended are JSON objects;
    with xgrammar's builtin JSON grammar four of them were arrays (`[5, 2]`)."""
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="demo_model", messages=[{"role": "user", "content": "Give me JSON."}],
        response_format={"type": "json_object"}, temperature=1.0, seed=0, n=16, max_tokens=48,
    )  # fmt: skip
    stopped = [c.message.content for c in reply.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(text), dict) for text in stopped), stopped


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutput("regex", "[a-"), "regex"),
        (StructuredOutput("ebnf", "root ::= missing"), "ebnf"),
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "json_schema"),
        (StructuredOutput("json_schema", "{not json"), "json_schema"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused(demo, spec, field):
    with pytest.raises(TierserveError) as err:
        demo.generate("hi", SamplingParams(structured_output=spec))
    assert err.value.field == field and "does not compile" in err.value.message


def test_a_builtin_structural_tag_compiles_as_the_tag_xgrammar_builds(demo):
    """A model family's tool-call format (server/tools.py) is compiled from the keyword
    arguments of xgrammar's get_builtin_structural_tag: the same grammar as the tag it builds;
    arguments it cannot take are the grammar's error, not the compiler's crash."""
    import xgrammar

    grammars = demo.engine.grammars
    kwargs = {"model": "qwen_3", "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": "required", "reasoning": "disabled"}  # fmt: skip
    tag = xgrammar.get_builtin_structural_tag(**kwargs).model_dump_json()
    built = grammars.compile(StructuredOutput("builtin_structural_tag", json.dumps(kwargs)))
    assert built == grammars.compile(StructuredOutput("structural_tag", tag))
    for bad in ("[]", json.dumps({**kwargs, "colour": "red"}), json.dumps({"model": "nope"})):
        with pytest.raises(TierserveError, match="builtin_structural_tag does not compile"):
            grammars.compile(StructuredOutput("builtin_structural_tag", bad))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutput("ebnf", "root ::= root"), "ebnf"),
        (StructuredOutput("ebnf", "root ::= a\na ::= b\nb ::= a"), "ebnf"),
        (StructuredOutput("regex", "[^\\x00-\\U0010FFFF]"), "regex"),
    ],
)
def test_a_grammar_that_matches_no_text_is_refused(demo, spec, field):
    """It compiles, but allows no first token: a sampled request had nothing to sample, and
    the failed step ended the server."""
    with pytest.raises(TierserveError) as err:
        demo.generate("hi", SamplingParams(temperature=1.0, structured_output=spec))
    assert err.value.field == field and "matches no text" in err.value.message


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_with_no_way_on_ends_its_request_with_a_stop(demo, temperature):
    """After its first token this grammar allows none (`x ::= x`): the request ends there
    with "stop" and the engine serves on; a sampled one failed the step (NaN probabilities)."""
    spec = StructuredOutput("ebnf", 'root ::= "a" x\nx ::= x')
    params = SamplingParams(max_tokens=8, temperature=temperature, structured_output=spec)
    out = demo.generate("well", params)[0]
    assert out.text == "a" and out.finish_reason == "stop", (out.text, out.finish_reason)
    plain = demo.generate("well", SamplingParams(max_tokens=4, temperature=1.0, seed=0))[0]
    assert plain.token_ids


def test_an_empty_grammar_is_refused():
    with pytest.raises(TierserveError) as err:
        StructuredOutput("regex", "")
    assert err.value.field == "regex"


# --- through a real server -------------------------------------------------------------------


def test_response_format_json_schema_streamed_and_not(llama_dir, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(
        model=llama_dir.name,
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=200,
        temperature=1.0,
        response_format=fmt,
    )
    for seed in range(3):
        whole = client.chat.completions.create(seed=seed, **kw).choices[0].message.content
        jsonschema.validate(json.loads(whole), PERSON)
        chunks = client.chat.completions.create(seed=seed, stream=True, **kw)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole


def test_response_format_json_object_in_completions(llama_dir, client):
    got = client.completions.create(
        model=llama_dir.name,
        prompt="json:",
        max_tokens=120,
        temperature=0.7,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(got.choices[0].text), dict)


def test_regex_in_completions_streamed_and_not(llama_dir, client):
    kw = dict(model=llama_dir.name, prompt="code:", max_tokens=30, temperature=1.0, seed=4)
    whole = client.completions.create(extra_body={"regex": CODE}, **kw).choices[0]
    assert re.fullmatch(CODE, whole.text) and whole.finish_reason == "stop"
    chunks = client.completions.create(extra_body={"regex": CODE}, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text


def test_sglang_regex_ebnf_and_json_schema_in_generate(server):
    def generate(**sampling) -> dict:
        body = {"text": "go", "sampling_params": {"max_new_tokens": 60, **sampling}}
        r = http.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert re.fullmatch(CODE, generate(regex=CODE)["text"])
    ebnf = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] | "x"'
    assert re.fullmatch(r"\(([0-9x])(, [0-9x])*\)", generate(ebnf=ebnf, temperature=1.0)["text"])
    out = generate(json_schema=json.dumps(PERSON), max_new_tokens=200, temperature=1.0)
    jsonschema.validate(json.loads(out["text"]), PERSON)


@pytest.mark.parametrize(
    "extra",
    [
        {"regex": "[a-"},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_object"}, "regex": "a+"},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_bad_structured_requests_are_400s(llama_dir, client, extra):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=llama_dir.name, prompt="x", max_tokens=4, extra_body=extra)


def test_vllms_structured_outputs_give_the_grammar_their_twins_give(llama_dir, client):
    """vLLM's `structured_outputs` names the same grammars as response_format, regex and
    ebnf (its `grammar` in Lark's syntax too, as vLLM's xgrammar backend takes it): the same
    sampled text for the same seed; `choice` is one of its strings, exactly."""
    kw = dict(model=llama_dir.name, prompt="x:", max_tokens=200, temperature=1.0)
    ebnf = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] | "x"'
    twins = [
        ({"json": PERSON}, {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "p", "schema": PERSON}}}),
        ({"json": json.dumps(PERSON)}, {"response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}),
        ({"regex": CODE}, {"regex": CODE}),
        ({"grammar": ebnf}, {"ebnf": ebnf}),
        ({"grammar": 'start: "(" item (", " item)* ")"\nitem: /[0-9]/ | "x"'}, {"ebnf": ebnf}),
        ({"json_object": True}, {"response_format": {"type": "json_object"}}),
    ]  # fmt: skip
    # Seed 6 for json_object: the random model's object under seed 5 is one string to max_tokens.
    for seed, (vllm, twin) in zip([0, 1, 2, 3, 4, 6], twins, strict=True):
        ours = client.completions.create(seed=seed, extra_body={"structured_outputs": vllm}, **kw)
        theirs = client.completions.create(seed=seed, extra_body=twin, **kw)
        assert ours.choices[0].text == theirs.choices[0].text, vllm
        assert ours.choices[0].finish_reason == "stop"
    choices = ["red", "green", 'say "blue"\n', "😀"]  # an emoji was the bytes of two halves
    texts = set()
    for seed in range(12):
        got = client.chat.completions.create(
            model=llama_dir.name, messages=[{"role": "user", "content": "a colour"}],
            max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        ).choices[0]  # fmt: skip
        assert got.message.content in choices and got.finish_reason == "stop"
        texts.add(got.message.content)
    assert len(texts) > 1  # sampled among them, not one forced string


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"structured_outputs": {}}, "exactly one of"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "whitespace"),
        ({"structured_outputs": {"regexp": "a+"}}, "regexp"),
        ({"structured_outputs": {"json_object": False}}, "json_object must be true"),
        ({"structured_outputs": {"regex": "a+"}, "regex": "b+"}, "not regex and structured"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "does not compile"),
    ],
)
def test_bad_structured_outputs_are_400s_that_say_why(llama_dir, client, extra, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=llama_dir.name, prompt="x", max_tokens=4, extra_body=extra)
    assert says in str(err.value), err.value
