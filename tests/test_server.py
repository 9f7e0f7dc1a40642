"""The HTTP server against real clients: the official `openai` package, raw SSE, /metrics."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server, eventually, hold_steps, http, random_prompts, running
from tierserve import SamplingParams
from tierserve.engine import STEP_GATE_ENV
from tierserve.utils import free_port


def test_completion_matches_offline_and_reports_usage(client, offline):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = offline.generate("Once upon a time", params)[0]
    got = client.completions.create(
        model="llama",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == expected.prompt_tokens
    assert got.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_uses_the_template_and_streams_usage(client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # The same prompt twice: the second is served from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    tok = offline.tokenizer
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False).input_ids)


def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm(client):
    """speculators' regenerate-responses sends max_tokens as a context budget and a length
    through max_completion_tokens; vLLM (and OpenAI's newer name) let the latter decide."""
    messages = [{"role": "user", "content": "hello there"}]
    body = {"ignore_eos": True, "max_completion_tokens": 3}
    got = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=40, temperature=0, extra_body=body
    )
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_stop_strings_are_not_emitted(client):
    full = client.completions.create(
        model="llama",
        prompt="The server",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    stop = text[5:7]
    cut = client.completions.create(
        model="llama", prompt="The server", max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"max_tokens": 100000},
        {"n": 0},
        {"prompt": ""},
        {"prompt": [999999]},
    ],
)
def test_invalid_requests_are_400(client, kwargs):
    body = {"model": "llama", "prompt": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body)
    assert err.value.status_code == 400
    assert err.value.body["message"]


def test_unknown_model_is_404_and_bad_json_400(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad = http.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    # curl -d labels a JSON body as a form: the 400 said the body was not an object.
    for route in ("/v1/completions", "/generate"):
        form = http.post(f"{server.url}{route}", data={"prompt": "hi"})
        assert form.status_code == 400, form.text
        message = form.json()["error"]["message"]
        assert "Content-Type: application/json" in message and "x-www-form-urlencoded" in message
    huge = http.post(
        f"{server.url}/v1/completions",
        content=b"x" * (17 * 1024 * 1024),
        headers={"content-type": "application/json"},
    )
    assert huge.status_code == 413


def test_tokenize_detokenize_version_and_one_model_as_vllm(client, server):
    """vLLM's routes: /tokenize gives the ids the completion and chat routes run on,
    /detokenize reads them back, /version, and the openai client's models.retrieve."""
    assert client.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    version = http.get(f"{server.url}/version").json()["version"]
    assert version == importlib.metadata.version("tierserve")

    def post(route: str, body: dict) -> httpx.Response:
        return http.post(f"{server.url}{route}", json=body, timeout=60)

    prompt = "The server counts"
    got = post("/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    ran = post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
    assert got["tokens"] == ran.json()["choices"][0]["prompt_token_ids"]
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"])
    assert got["max_model_len"] == 2048
    bare = post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert post("/detokenize", {"tokens": bare}).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "hi there"}]
    chat = post("/tokenize", {"messages": messages}).json()["tokens"]
    ran = post("/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                        "return_token_ids": True})  # fmt: skip
    assert chat == ran.json()["prompt_token_ids"]
    assert chat == post("/v1/chat/completions/render", {"messages": messages}).json()["token_ids"]
    assert post("/detokenize", {"tokens": [-1]}).status_code == 400
    assert post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert post("/tokenize", {}).status_code == 400
    # Counted however long, as vLLM does: count > max_model_len says it does not fit.
    long = post("/tokenize", {"prompt": "word " * 30_000}).json()
    assert long["count"] > long["max_model_len"]


def test_tokenize_adds_special_tokens_to_chat_only_when_asked(demo_server):
    """vLLM's chat default adds none (the template writes them); asked, the tokenizer's are
    added to the rendered text, as a plain prompt gets them (the demo tokenizer's BOS)."""

    def tokens(body: dict) -> list[int]:
        return http.post(f"{demo_server.url}/tokenize", json=body, timeout=60).json()["tokens"]

    messages = [{"role": "user", "content": "Good morrow."}]
    chat = tokens({"messages": messages})
    text = http.post(f"{demo_server.url}/detokenize", json={"tokens": chat}, timeout=60)
    plain = tokens({"prompt": text.json()["prompt"]})
    assert tokens({"messages": messages, "add_special_tokens": True}) == plain != chat


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "valid Unicode"),  # was a 500
        ({"messages": []}, "messages"),  # each was "TokenizeText.prompt: Field required"
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "bogus", "content": "x"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": "x"}], "return_token_strs": "yes"},
         "return_token_strs"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "not both"),
        ({"prompt": 5}, "prompt"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
          {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages.0"),
    ],
)  # fmt: skip
def test_a_malformed_tokenize_body_is_a_400_naming_its_field(server, body, says):
    def post(route: str) -> httpx.Response:  # JSON escapes carry the lone surrogate
        head = {"content-type": "application/json"}
        return http.post(f"{server.url}{route}", content=json.dumps(body), headers=head, timeout=60)

    got = post("/tokenize")
    assert got.status_code == 400 and says in got.json()["error"]["message"], got.text
    if says.startswith(("messages", "valid Unicode")):  # the chat routes read messages alike
        for route in ("/v1/chat/completions/render", "/v1/chat/completions"):
            got = post(route)
            assert got.status_code == 400, got.text


def test_context_length_error_states_the_limit(client):
    with pytest.raises(openai.BadRequestError, match="context length 2048"):
        client.completions.create(model="llama", prompt=[5] * 2040, max_tokens=20)
    # Each named a field the client never sent ("min_tokens must be in [0, max_tokens]").
    with pytest.raises(openai.BadRequestError, match="min_tokens 20 > the 8 tokens"):
        client.completions.create(model="llama", prompt=[5] * 2040, extra_body={"min_tokens": 20})
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be >= 1"):
        client.chat.completions.create(model="llama", messages=messages, max_completion_tokens=0)


def test_native_generate_takes_token_ids(server):
    reply = http.post(
        f"{server.url}/generate",
        json={
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        },
    )
    body = reply.json()
    assert reply.status_code == 200 and len(body["output_ids"]) <= 5
    assert body["meta_info"]["prompt_tokens"] == 4


def test_64_concurrent_streams_match_offline_greedy(server, offline):
    prompts = random_prompts(64, [8, 30, 65, 120], seed=80)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> str:
        stream = await client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_streams() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x") as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_streams()) == expected


def test_aborted_streams_free_their_kv(server):
    before = server.metrics().get("tierserve_requests_total{status=abort}", 0)

    async def abort_half_way(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": [7 + i] * 50, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            seen = 0
            async for line in reply.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 5:
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await asyncio.gather(*(abort_half_way(client, i) for i in range(20)))

    # 60 steps give each stream its 5 chunks and no stream its 400 tokens, however fast.
    server.hold_steps(60)
    try:
        asyncio.run(run())
    finally:
        server.release_steps()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["tierserve_num_requests_running"] == 0 and m["tierserve_num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m["tierserve_num_requests_running"] == 0
    assert (
        m["tierserve_kv_pages_used{tier=device}"] == m["tierserve_radix_cached_pages{tier=device}"]
    )
    assert m["tierserve_requests_total{status=abort}"] - before == 20
    assert m["tierserve_generation_tokens_total"] < 20 * 400


def test_metrics_parse_and_move(server, client):
    before = server.metrics()
    client.completions.create(
        model="llama",
        prompt="count me",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()
    assert (
        after["tierserve_generation_tokens_total"]
        == before["tierserve_generation_tokens_total"] + 3
    )
    assert after["tierserve_requests_total{status=length}"] > before.get(
        "tierserve_requests_total{status=length}", 0
    )
    assert (
        after["tierserve_time_to_first_token_seconds_count"]
        > before["tierserve_time_to_first_token_seconds_count"]
    )
    assert after["tierserve_kv_pages_capacity{tier=device}"] == 4096 // 16
    # Prometheus' conventions: `_total` names counters only; no `_created` series beside them.
    text = http.get(f"{server.url}/metrics").text
    families = list(text_string_to_metric_families(text))
    assert not [f.name for f in families if f.type == "gauge" and f.name.endswith("_total")]
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]
    rank, node = (after[f"tierserve_kv_bytes{{scope={s},tier=device}}"] for s in ("rank", "node"))
    assert node == rank * after["tierserve_local_ranks"] and rank > 0  # each rank's own pool


def test_vllms_metric_names_show_the_same_values(server, client):
    """A dashboard built for vLLM reads `vllm:*` series labelled model_name and engine; each
    is the same scrape's tierserve value."""
    client.completions.create(model="llama", prompt="count me too", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    m = server.metrics()
    at = "{engine=0,model_name=llama}"
    same = {
        "vllm:num_requests_running": "tierserve_num_requests_running",
        "vllm:num_requests_waiting": "tierserve_num_requests_waiting",
        "vllm:prompt_tokens_total": "tierserve_prompt_tokens_total",
        "vllm:generation_tokens_total": "tierserve_generation_tokens_total",
        "vllm:prefix_cache_queries_total": "tierserve_prompt_tokens_total",
        "vllm:time_to_first_token_seconds_count": "tierserve_time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_sum": "tierserve_e2e_request_latency_seconds_sum",
    }
    for theirs, ours in same.items():
        assert m[theirs + at] == m[ours], theirs
    assert m["vllm:generation_tokens_total" + at] >= 3
    hits = sum(v for k, v in m.items() if k.startswith("tierserve_cached_tokens_total"))
    assert m["vllm:prefix_cache_hits_total" + at] == hits
    length = "vllm:request_success_total{engine=0,finished_reason=length,model_name=llama}"
    assert m[length] == m["tierserve_requests_total{status=length}"] >= 1
    used, pages = (m[f"tierserve_kv_pages_{k}{{tier=device}}"] for k in ("used", "capacity"))
    assert m["vllm:kv_cache_usage_perc" + at] == used / pages


def test_sigterm_drains_in_flight_requests(llama_dir):
    s = Server(llama_dir, "--max-total-tokens", "2048")
    try:
        body = {
            "prompt": [5] * 20,
            "max_tokens": 120,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        with http.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 120
        # uvicorn re-raises the signal once drained, so the status says "ended by SIGTERM".
        assert s.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        s.stop()


def listening(url: str) -> bool:
    """Whether `url` takes a new request: refused once the port closed, or reset when the
    connection reached the backlog of a socket closing meanwhile."""
    try:
        http.get(f"{url}/health", timeout=10)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return False
    except httpx.TimeoutException:  # a slow machine's answer: still there, asked again
        return True
    return True


def test_a_second_ctrl_c_cuts_open_streams_with_one_line_and_no_traceback(llama_dir):
    """uvicorn's forced shutdown logged a CancelledError traceback per open request and one
    for the lifespan; the user asked for exactly that cut."""
    s = Server(llama_dir, "--max-total-tokens", "2048")
    try:
        core = s.core
        s.hold_steps(2)  # the stream stays open until the server is forced down
        body = {"prompt": [5] * 20, "max_tokens": 100, "stream": True, "ignore_eos": True}
        with http.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            s.proc.send_signal(signal.SIGINT)
            assert eventually(lambda: not listening(s.url), 60)  # draining: its port closed
            s.proc.send_signal(signal.SIGINT)
            with pytest.raises(httpx.HTTPError):
                list(lines)  # cut mid-stream
        s.proc.wait(timeout=60)
        log = s.log_tail(100_000)
        assert "forced shutdown (a second signal): open requests are cut" in log
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert eventually(lambda: not running(core.pid), 30)
    finally:
        s.release_steps()
        s.stop()


def test_server_with_hierarchical_cache_reports_host_tier(llama_dir):
    s = Server(
        llama_dir,
        "--max-total-tokens",
        "256",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "8",
    )
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x")
        prompts = random_prompts(4, [150], seed=81)
        for _ in range(2):
            for p in prompts:
                c.completions.create(model="llama", prompt=p, max_tokens=2, temperature=0)
        m = s.metrics()
        assert m["tierserve_cached_tokens_total{tier=host}"] > 0
        assert m["tierserve_kv_pages_capacity{tier=host}"] > 0
        assert m["tierserve_load_back_tokens_total"] > 0
        assert m["tierserve_backup_bytes_total"] > 0 and m["tierserve_load_back_bytes_total"] > 0
        assert m["tierserve_copies_in_flight"] == 0  # the CPU copy path lands what it issues
        assert "tierserve_deferred_evictions_total" in m
    finally:
        s.stop()


def write_batch_input(path: Path, n: int, model: str = "gpt-x") -> None:
    """`gpt-x`: any name an in-process engine answers for; a server answers for its own."""
    with path.open("w") as f:
        for i in range(n):
            body = {
                "model": model,
                "prompt": [3 + i % 50] * 30,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            line = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")


def batch_command(src: Path, out: Path, *flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out)]
    return cmd + ["--concurrency", "4", "--no-progress", *flags]


def test_batch_runner_resumes_after_a_kill(llama_dir, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_batch_input(src, 40)
    cmd = batch_command(src, out, "--model", str(llama_dir))
    # 150 batches of at most 4 tokens (4 requests at a time) finish at most 25 of the 40 lines
    # of 24 tokens: then the run holds, and is killed part-way however fast the machine is.
    gate = tmp_path / "gate"
    hold_steps(gate, 150)
    first = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, env={**os.environ, STEP_GATE_ENV: str(gate)}
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 5):
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    partial = out.read_text().count("\n")
    assert 5 <= partial < 40, "kill the run part-way"
    with out.open("a") as f:
        f.write('{"id": "torn')  # a line cut off by the kill
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{partial} already done" in done.stderr
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(40))
    assert all(
        json.loads(line)["response"]["status_code"] == 200 for line in out.read_text().splitlines()
    )


def test_without_max_tokens_a_request_runs_to_the_context_end(client):
    got = client.completions.create(
        model="llama", prompt=[5] * 2000, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 2048 - 2000
    assert got.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="leaves no room"):
        client.completions.create(model="llama", prompt=[5] * 2048)


NULLABLE = ("top_p", "n", "presence_penalty", "frequency_penalty", "stream", "top_k", "min_p",
            "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens", "seed",
            "stop", "logit_bias", "logprobs")  # fmt: skip


def test_a_field_sent_as_null_takes_its_default(server):
    """Clients send parameters they leave unset as null (OpenAI's spec and vLLM allow it):
    each was a 400, "Input should be a valid number"."""
    base = {"max_tokens": 6, "temperature": 0}
    for route, extra in (
        ("/v1/completions", {"prompt": "The server", "echo": None}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "parallel_tool_calls": None, "top_logprobs": None}),
    ):  # fmt: skip
        plain = http.post(f"{server.url}{route}", json={**base, **extra}, timeout=60)
        nulls = {**base, **extra, **dict.fromkeys(NULLABLE)}
        reply = http.post(f"{server.url}{route}", json=nulls, timeout=60)
        assert plain.status_code == reply.status_code == 200, reply.text
        text = [c.get("text", c.get("message")) for c in reply.json()["choices"]]
        assert text == [c.get("text", c.get("message")) for c in plain.json()["choices"]]


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("/v1/completions", "guided_choice", ["yes", "no"]),
        ("/v1/completions", "return_tokens_as_token_ids", True),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "cache_salt", "tenant-a"),
        ("/v1/completions", "top_logprobs", 3),
        ("/v1/completions", "max_completion_tokens", 3),
        ("/v1/chat/completions", "guided_json", {"type": "object"}),
        ("/v1/chat/completions", "echo", True),
        ("/v1/chat/completions", "logprobs", 1),  # read as true
        ("/v1/chat/completions", "stream_options", {"include_usage": True}),  # no stream
    ],
)
def test_fields_that_would_change_the_answer_are_refused_not_ignored(server, route, field, value):
    """vLLM's extensions, and the other route's fields: each was a 200 that answered as if
    it had not been sent."""
    body = {"max_tokens": 2, field: value}
    if route == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    reply = http.post(f"{server.url}{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]
    body.pop(field)
    body |= {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    reply = http.post(f"{server.url}{route}", json=body, timeout=60)
    assert reply.status_code == 400 and "continuous_usage_stats" in reply.text, reply.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"five": 10}}'),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 1000}}'),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"99999": 1}}'),
        ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 3}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "min_tokens": 3}'),
        ("/generate", b'{"input_ids": [5], "sampling_params": {"repetition_penalty": 0}}'),
        ("/v1/completions", b'{"prompt": "hi", "seed": 1180591620717411303424}'),
        ("/v1/completions", b'{"prompt": "hi", "top_k": 2.5}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"top_k": 2.5}}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": "hot"}}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"stop": 5}}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"nucleus": 0.9}}'),
        # Each of these ended the engine core, and the server with it (a failed step).
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "ebnf": "root ::= root"}'),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [100000]}',
        ),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [-1]}',
        ),
        # Past 64 bits: a 500 from the core's message encoder.
        ("/v1/completions", b'{"prompt": "hi", "top_k": 1180591620717411303424}'),
        ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [18446744073709551616]}'),
        ("/generate", b'{"input_ids": [5], "sampling_params": {"top_k": 18446744073709551616}}'),
        # Each was a 200 that ignored what the client asked: a misspelt sampling_params (128
        # tokens), an image given as 0 (0 == False), two limits at once (one ignored).
        ("/generate", b'{"input_ids": [5], "sampling_param": {"max_new_tokens": 2}}'),
        ("/generate", b'{"input_ids": [5], "image_data": 0}'),
        (
            "/generate",
            b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "max_tokens": 5}}',
        ),
    ],
)
def test_bad_values_are_400_and_the_engine_keeps_serving(server, route, body):
    # A hang bound: a grammar's first compile starts the server's compile worker (its imports).
    reply = http.post(
        f"{server.url}{route}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"]
    assert http.get(f"{server.url}/health").status_code == 200


def test_a_refused_request_leaves_its_request_id_free(server):
    """A request refused before it reached the engine is not left in flight: its id may be
    used again (once, a 500 kept it for good, and counted it as waiting)."""
    url = f"{server.url}/generate"
    huge = {"input_ids": [5], "rid": "again", "sampling_params": {"top_k": 2**70}}
    assert http.post(url, json=huge).status_code == 400
    ok = {"input_ids": [5], "rid": "again", "sampling_params": {"max_new_tokens": 2}}
    reply = http.post(url, json=ok, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1/0 }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for i in range(10**9) %}{% endfor %}x",
    ],
)
def test_a_request_template_that_fails_is_a_400(server, template):
    """A request's own template is code (the shared server trusts it): one that raises is the
    request's error, never a 500."""
    messages = [{"role": "user", "content": "hi"}]
    for route in ("/v1/chat/completions", "/v1/chat/completions/render"):
        body = {"messages": messages, "max_tokens": 2, "chat_template": template}
        reply = http.post(f"{server.url}{route}", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert "the chat template failed" in reply.json()["error"]["message"]


def test_a_streamed_batch_with_a_prompt_refused_late_ends_with_an_error_event(server):
    """A batch's second prompt, too long for the context, is refused when it has tokenized,
    which may be after the first prompt's tokens were streamed: the stream then ends with an
    error event, where it was cut without one. Either way the client is told."""
    body = {"prompt": ["hi", "hello " * 5000], "max_tokens": 8, "stream": True}
    with http.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as reply:
        if reply.status_code == 400:  # refused before the first byte
            assert "exceeds the context length" in reply.read().decode()
            return
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == 400, events
    assert "exceeds the context length" in last["error"]["message"]


def test_extreme_but_valid_values_do_not_break_a_batch(client):
    for extra in ({"temperature": 1e-50}, {"top_p": 1e-50}):
        got = client.completions.create(model="llama", prompt="hi", max_tokens=4, **extra)
        assert got.usage.completion_tokens >= 1


# --- hostile but fair input --------------------------------------------------------------------

SURROGATE = '"\\ud800"'  # a lone UTF-16 surrogate, as JSON allows it


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", '{"prompt": ' + SURROGATE + "}"),
        ("/v1/completions", '{"prompt": "hi", "model": ' + SURROGATE + "}"),
        ("/v1/completions", '{"prompt": "hi", "stop": [' + SURROGATE + "]}"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + SURROGATE + "}]}"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": '
            + SURROGATE
            + "}]}]}",
        ),
        ("/generate", '{"text": ' + SURROGATE + "}"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}',
        ),
        ("/v1/completions", '{"prompt": [5, true, 7]}'),
        ("/v1/completions", '{"prompt": [5, 6.0, 7]}'),
        ("/generate", '{"input_ids": [5, false]}'),
        ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [1.5]}'),
    ],
)
def test_hostile_bodies_get_openai_400s(server, route, body):
    reply = http.post(
        f"{server.url}{route}",
        content=body.encode(),
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert http.get(f"{server.url}/health").status_code == 200


JSON = {"content-type": "application/json"}


def _nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize(("depth", "kind"), [(400, "dict"), (1000, "list"), (10_000, "dict")])
def test_deeply_nested_bodies_are_400s_naming_the_limit(server, route, depth, kind):
    """Nesting that once ran a walk out of stack (a 500 with a RecursionError) is refused
    before anything parses it; a body at the limit is still read."""
    head = {
        "/v1/completions": '{"prompt": "A", "max_tokens": 1, ',
        "/v1/chat/completions": '{"messages": [{"role": "user", "content": "A"}], '
        '"max_tokens": 1, ',
        "/generate": '{"text": "A", "sampling_params": {"max_new_tokens": 1}, ',
    }[route]
    reply = http.post(
        f"{server.url}{route}",
        content=(head + '"foo": ' + _nested(depth, kind) + "}").encode(),
        headers=JSON,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "128 levels" in error["message"]
    if route != "/generate":  # /generate forbids unknown fields: there a shallow one is a 400
        shallow = head + '"foo": ' + _nested(100, kind) + "}"
        ok = http.post(f"{server.url}{route}", content=shallow.encode(), headers=JSON, timeout=60)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/nope", 404), ("GET", "/generate", 405)]
)
def test_unknown_routes_and_methods_get_openai_errors(server, method, path, status):
    reply = httpx.request(method, f"{server.url}{path}")
    assert reply.status_code == status
    assert set(reply.json()) == {"error"} and reply.json()["error"]["code"] == status


def test_chunked_bodies_are_held_to_the_limit(server):
    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    reply = http.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == 413
    assert http.get(f"{server.url}/health").status_code == 200


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    """The engine may run three steps (the prefill and two decodes), then holds: the request
    is running, unfinished, when its client gives up, however fast the machine is."""
    before = server.metrics()
    body = {"prompt": [9] * 40, "max_tokens": 1500, "ignore_eos": True}
    aborts = "tierserve_requests_total{status=abort}"
    server.hold_steps(3)
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            http.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=2))
        server.wait_for(
            lambda m: (
                m.get(aborts, 0) > before.get(aborts, 0)
                and m["tierserve_num_requests_running"] == 0
            )
        )
    finally:
        server.release_steps()
    after = server.metrics()
    assert after["tierserve_num_requests_running"] == 0
    assert after.get(aborts, 0) - before.get(aborts, 0) == 1
    generated = (
        after["tierserve_generation_tokens_total"] - before["tierserve_generation_tokens_total"]
    )
    assert generated == 3  # one token a step: the three the gate let run, none after the abort


def test_api_key_and_a_bounded_waiting_queue(llama_dir):
    s = Server(
        llama_dir,
        "--api-key",
        "sesame",
        "--max-queued-requests",
        "1",
        "--max-running-requests",
        "1",
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
        bad = http.post(f"{s.url}/v1/completions", content=b"{not json")
        assert bad.status_code == 401  # the key is checked before the body is read
        assert http.get(f"{s.url}/health").status_code == 200
        assert http.get(f"{s.url}/metrics").status_code == 200
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sesame", max_retries=0)
        assert c.completions.create(model="llama", prompt="hi", max_tokens=2).choices

        async def burst() -> list[int]:
            headers = {"authorization": "Bearer sesame"}
            # Two tokens or more: the first is still running after the one step it is let run.
            body = {"prompt": [5] * 20, "max_tokens": 8, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=s.url, headers=headers, timeout=120) as h:

                def send() -> asyncio.Future:
                    return asyncio.ensure_future(h.post("/v1/completions", json=body))

                async def until(ready: Callable[[dict[str, float]], bool]) -> None:
                    await asyncio.to_thread(s.wait_for, ready)

                # One runs, one waits, the third finds the queue full; the engine's steps are
                # held, so none finishes before the test says.
                s.hold_steps(0)
                first = send()
                await until(lambda m: m["tierserve_num_requests_waiting"] == 1)
                s.hold_steps(1)  # one step: the first is admitted and prefilled
                await until(lambda m: m["tierserve_num_requests_running"] == 1)
                await until(lambda m: m["tierserve_num_requests_waiting"] == 0)
                second = send()
                await until(lambda m: m["tierserve_num_requests_waiting"] == 1)
                third = (await h.post("/v1/completions", json=body)).status_code
                s.release_steps()
                return [(await first).status_code, (await second).status_code, third]

        assert asyncio.run(burst()) == [200, 200, 503]
    finally:
        s.stop()


def test_text_no_context_could_hold_is_refused_before_tokenizing(server):
    huge = "word " * 200_000  # 1 MB: 2048 tokens of context could never hold it
    for route, body in (
        ("/v1/completions", {"prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/generate", {"text": huge}),
    ):
        reply = http.post(f"{server.url}{route}", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        # This message comes from the length check that runs before the tokenizer.
        assert "cannot fit in the context" in reply.json()["error"]["message"]


def test_a_trusted_request_template_runs_and_its_render_is_held_to_the_context(server):
    """The shared server runs with --trust-request-chat-template: a request's own template
    renders; one whose text passes the context × 32 characters is a 400 before tokenizing (the
    reported 130-byte body rendered 8 MB and 4 M token ids)."""
    messages = [{"role": "user", "content": "hi"}]
    url = f"{server.url}/v1/chat/completions/render"
    own = http.post(url, json={"messages": messages, "chat_template": "{{ 'a b ' * 3 }}"})
    assert own.status_code == 200 and own.json()["token_ids"]
    huge = {"messages": messages, "chat_template": "{{ 'a b ' * 2000000 }}"}
    reply = http.post(url, json=huge, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "8,000,000 characters cannot fit in the context" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"stop": [f"s{i}" for i in range(65)]},
        {"stop": ["x" * 513]},
        {"stop_token_ids": list(range(1025))},
    ],
)
def test_per_request_lists_have_stated_limits(client, extra):
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model="llama", prompt="hi", max_tokens=2, extra_body=extra)


def test_a_body_that_trickles_in_gets_a_408(server):
    """A client may not hold a request open by sending its body slowly (--body-timeout 2)."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "')
        started = time.monotonic()
        reply = sock.recv(4096).decode()
        waited = time.monotonic() - started
        while "}}" not in reply and (more := sock.recv(4096)):
            reply += more.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"code": 408' in reply and 1.5 < waited < 20
    assert http.get(f"{server.url}/health").status_code == 200


def test_rejected_requests_are_not_counted_as_aborts(server):
    before = server.metrics()
    reply = http.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 10**9})
    assert reply.status_code == 400
    after = server.metrics()
    aborts = "tierserve_requests_total{status=abort}"
    assert after.get(aborts, 0) == before.get(aborts, 0)


def test_batch_rerun_retries_failed_lines_and_names_a_corrupt_one(server, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_batch_input(src, 6, model="llama")  # the shared server's name
    down = batch_command(src, out, "--url", f"http://127.0.0.1:{free_port()}", "--max-retries", "0")

    def statuses() -> dict[str, list[int]]:
        seen: dict[str, list[int]] = {}
        for line in out.read_text().splitlines():
            record = json.loads(line)
            seen.setdefault(record["custom_id"], []).append(record["response"]["status_code"])
        return seen

    failed = subprocess.run(down, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1, failed.stderr  # no server: every line failed
    assert statuses() == {f"req-{i}": [599] for i in range(6)}
    kept = subprocess.run(down + ["--no-retry-failed"], capture_output=True, text=True)
    assert kept.returncode == 1 and "6 failed earlier and kept" in kept.stderr
    assert len(out.read_text().splitlines()) == 6

    retried = batch_command(src, out, "--url", server.url)  # the in-process engine: above
    done = subprocess.run(retried, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert statuses() == {f"req-{i}": [200] for i in range(6)}  # replaced, not appended to

    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + "not json\n" + "".join(lines[2:]))
    corrupt = subprocess.run(retried, capture_output=True, text=True, timeout=300)
    assert corrupt.returncode == 2
    assert f"{out}:3: not a batch output line" in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", ":2: not a JSON object"),
        ('{"custom_id": 5, "url": "/v1/completions", "body": {}}', ":2: custom_id must be"),
        ('{"custom_id": "b", "url": "/v1/completions", "body": "x"}', ":2: custom_id must be"),
    ],
)
def test_batch_input_lines_of_the_wrong_shape_are_named(tmp_path, line, message):
    from tierserve import TierserveError
    from tierserve.batch.runner import read_input

    good = '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}'
    src = tmp_path / "in.jsonl"
    src.write_text(good + "\n" + line + "\n")
    with pytest.raises(TierserveError) as err:
        read_input(src)
    assert message in err.value.message


def test_batch_lines_for_other_routes_methods_or_hosts_are_their_own_errors(server, tmp_path):
    """A url of another type, one httpx cannot parse, another host, a route that is no batch
    endpoint, a GET: each line is written with its 400 error, unsent, and the good line still
    runs. Each of the first three ended the whole run with a traceback; the others were sent."""
    from tierserve import cli

    good = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    bad = {
        "int": ("POST", 5), "null": ("POST", None), "torn": ("POST", "http://[::1"),
        "host": ("POST", "http://example.com/v1/completions"), "flush": ("POST", "/flush_cache"),
        "embed": ("POST", "/v1/embeddings"), "get": ("GET", "/v1/completions"),
    }  # fmt: skip
    lines = [("ok", "POST", "/v1/completions")] + [(k, m, u) for k, (m, u) in bad.items()]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c, "method": m, "url": u, "body": good})
                           + "\n" for c, m, u in lines))  # fmt: skip
    code = cli.main(["batch", str(src), "-o", str(out), "--url", server.url, "--no-progress",
                     "--max-retries", "0"])  # fmt: skip
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and sorted(records) == sorted(["ok", *bad])
    assert records["ok"]["response"]["status_code"] == 200
    assert records["ok"]["response"]["body"]["usage"]["completion_tokens"] == 2
    for custom_id in bad:
        record = records[custom_id]
        assert record["response"]["status_code"] == 400, record
        error = record["error"]
        assert error == record["response"]["body"]["error"]
        assert error["param"] == ("method" if custom_id == "get" else "url"), error
    assert "/v1/chat/completions, /v1/completions" in records["flush"]["error"]["message"]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full"])
def test_a_batch_output_that_is_no_regular_file_is_refused_at_once(tmp_path, device):
    """-o /dev/zero read the output to resume, forever, at ~600 MB/s of memory. Run under a
    512 MiB address-space bound, so that a regression fails here instead of taking the
    machine's memory."""
    import resource

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", device,
           "--url", "http://127.0.0.1:9"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=bounded)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == f"tierserve batch: error: --output {device} is not a regular file: " + (
        "a run reads its output to resume and rewrites it; give a file's path\n"
    )
    assert not Path(device + ".lock").exists()


def test_stop_reason_and_include_stop_str_in_output_as_vllm(client):
    """Each choice says what stopped it (vLLM's `stop_reason`: the stop string or the
    stop_token_ids id, None for EOS and length); include_stop_str_in_output keeps it in the
    text, streamed and not, in completions and chat."""
    kw = dict(model="llama", prompt="The server", max_tokens=12, temperature=0)
    plain = client.completions.create(**kw).choices[0]
    assert plain.finish_reason == "length" and plain.stop_reason is None
    ids = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    stop = plain.text[3:7]  # greedy: the same text again, cut inside it
    for include in (False, True):
        extra = {"include_stop_str_in_output": include}
        got = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
        kept = plain.text[: plain.text.index(stop) + (len(stop) if include else 0)]
        assert (got.text, got.finish_reason, got.stop_reason) == (kept, "stop", stop)
        streamed = list(client.completions.create(**kw, stop=[stop], stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in streamed) == kept
        assert streamed[-1].choices[0].stop_reason == stop
        first = next(i for i, t in enumerate(ids.token_ids) if i and t not in ids.token_ids[:i])
        token = ids.token_ids[first]  # the first token of the output that is new there
        got = client.completions.create(
            **kw, extra_body={**extra, "stop_token_ids": [token], "return_token_ids": True}
        ).choices[0]
        assert (got.finish_reason, got.stop_reason) == ("stop", token)
        assert got.token_ids == ids.token_ids[: first + 1]
        shown = client.completions.create(**{**kw, "max_tokens": first + include}).choices[0]
        assert got.text == shown.text  # the stop token's text only when included
    chat = dict(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                temperature=0)  # fmt: skip
    said = client.chat.completions.create(**chat).choices[0].message.content
    got = client.chat.completions.create(**chat, stop=[said[2:5]]).choices[0]
    assert (got.message.content, got.stop_reason) == (said[: said.index(said[2:5])], said[2:5])


def _holds(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_bad_words_are_never_generated_as_vllm_bans_them(client, llama_dir):
    """vLLM's bad_words (refused before): a word's last token is banned wherever the output
    ends with its tokens before it, so greedy output keeps its first tokens and turns at its
    last; a banned token stays banned against a +100 logit_bias, greedy or sampled."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    kw = dict(model="llama", prompt="The server", max_tokens=24, temperature=0)
    plain = dict(extra_body={"return_token_ids": True, "ignore_eos": True})
    base = client.completions.create(**kw, **plain).choices[0].token_ids
    # a two-token word of the output whose text tokenizes to just those two tokens
    i = next(i for i in range(len(base) - 1) if ids(tok.decode(base[i : i + 2])) == base[i : i + 2])
    word = tok.decode(base[i : i + 2])
    extra = {"return_token_ids": True, "ignore_eos": True, "bad_words": [word]}
    got = client.completions.create(**kw, extra_body=extra).choices[0].token_ids
    first = next(j for j in range(len(base) - 1) if base[j : j + 2] == base[i : i + 2])
    assert got[: first + 1] == base[: first + 1] and got[first + 1] != base[first + 1]
    assert not _holds(got, base[i : i + 2])
    one = next(t for t in base if ids(tok.decode([t])) == [t])  # a word of one token
    for temperature, seed in ((0, None), (1.0, 5), (1.0, 6)):
        extra = {"return_token_ids": True, "bad_words": [tok.decode([one])],
                 "logit_bias": {str(one): 100}}  # fmt: skip
        got = client.completions.create(
            **{**kw, "temperature": temperature}, seed=seed, extra_body=extra
        ).choices[0]
        assert got.finish_reason == "length" and one not in got.token_ids
    chat = dict(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    pushed = {"return_token_ids": True, "logit_bias": {str(one): 100}}
    said = client.chat.completions.create(**chat, extra_body=pushed).choices[0]
    assert said.token_ids == [one] * 4
    banned = {**pushed, "bad_words": [tok.decode([one])]}
    said = client.chat.completions.create(**chat, extra_body=banned).choices[0]
    assert said.token_ids and one not in said.token_ids
    url = f"{client.base_url}completions"
    for bad, says in (
        ([""], "empty"), (["  "], "blank"), ("the", "bad_words"),
        (["w"] * 3 + [f"w{k}" for k in range(200)], "at most 128"), (["\ud800"], "surrogate"),
    ):  # fmt: skip
        body = json.dumps({"prompt": "x", "max_tokens": 4, "bad_words": bad})  # ASCII: "\ud800"
        reply = http.post(url, content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ("a", "b")


def test_allowed_token_ids_and_truncate_prompt_tokens_as_vllm(client):
    """allowed_token_ids: every sampled token is one of them, greedy and sampled;
    truncate_prompt_tokens: the request runs on the prompt's last k tokens, as that tail sent
    as ids does (both were refused)."""
    allowed = [7, 11, 13]
    for temperature, seed in ((0, None), (1.0, 3)):
        got = client.completions.create(
            model="llama", prompt="The server", max_tokens=16, temperature=temperature,
            seed=seed, extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        ).choices[0]  # fmt: skip
        assert len(got.token_ids) == 16 and set(got.token_ids) <= set(allowed)
    prompt = [5, 9, 200, 31, 77, 140, 3, 18]
    whole = dict(model="llama", max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    tail = client.completions.create(prompt=prompt[-3:], **whole).choices[0]
    cut = client.completions.create(
        prompt=prompt, **{**whole, "extra_body": {"return_token_ids": True,
                                                   "truncate_prompt_tokens": 3}}
    ).choices[0]  # fmt: skip
    assert cut.prompt_token_ids == prompt[-3:] and cut.token_ids == tail.token_ids
    text = "word " * 20_000  # past the context: cut to its last 100 tokens
    long = client.completions.create(
        model="llama", prompt=text, max_tokens=1,
        extra_body={"truncate_prompt_tokens": 100, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    whole = http.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                      json={"prompt": text}, timeout=60).json()["tokens"]  # fmt: skip
    assert long.prompt_token_ids == whole[-100:]
    for max_tokens, kept in ((None, 2047), (5, 2043)):  # -1: the room to generate is kept
        fits = client.completions.create(
            model="llama", prompt=text, max_tokens=max_tokens,
            extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True},
        )  # fmt: skip
        assert fits.usage.prompt_tokens == kept and fits.usage.completion_tokens == 2048 - kept
    assert SamplingParams(allowed_token_ids=[5, 5, 6, 5]).allowed_token_ids == (5, 6)
    for extra, says in (
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(5000))}, "allowed_token_ids"),  # past the vocabulary
        ({"allowed_token_ids": [5], "response_format": {"type": "json_object"}}, "structured"),
        ({"allowed_token_ids": [1], "stop_token_ids": [1], "min_tokens": 2}, "never be met"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        with pytest.raises(openai.BadRequestError, match=says):
            client.completions.create(model="llama", prompt="x", max_tokens=4, extra_body=extra)
