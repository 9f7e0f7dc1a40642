"""Grammar compiles with a budget: grammars past the documented limits are 400s before any
compile; a compile past --grammar-compile-timeout is ended (its process killed) and answered 400;
compiles whose clients leave are ended, queued or running, and plain requests are served beside
them. Ordered by the server's own counters, never by how long a compile takes here."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.conftest import Server, eventually, http
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.frontend.grammar import MAX_GRAMMAR_CHARS, MAX_SCHEMA_ENUM_VALUES, check_size
from tierserve.frontend.grammar_worker import COMPILE_HOLD_ENV
from tierserve.sampling_params import StructuredOutput

ENDED = "tierserve_grammar_compiles_ended_total{reason=%s}"


def big_enum_body(seed: int, values: int = 500, chars: int = 5_000) -> dict:
    """The reported hostile grammar: an enum of 500 strings of 5,000 characters (2.5 MB), which
    compiled for more than ten minutes."""
    enum = [f"{seed}-{i}-" + "x" * chars for i in range(values)]
    schema = {"type": "object", "properties": {"a": {"enum": enum}}, "required": ["a"]}
    return {
        "prompt": "A",
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}},
    }


def compile_workers(server: Server) -> list[psutil.Process]:
    """`server`'s compile processes that still run (one that exits meanwhile does not count)."""
    running = []
    for p in psutil.Process(server.proc.pid).children():
        try:
            alive = p.status() != psutil.STATUS_ZOMBIE
            if alive and "tierserve.frontend.grammar_worker" in " ".join(p.cmdline()):
                running.append(p)
        except psutil.NoSuchProcess:
            continue
    return running


@pytest.fixture(scope="module")
def patient(llama_dir, tmp_path_factory) -> Iterator[Server]:
    """A server whose compile time limit no test reaches: compiles end only when clients leave.
    Its compile workers wait before compiling while `s.compile_hold` exists."""
    hold = tmp_path_factory.mktemp("compile") / "hold"
    s = Server(
        llama_dir, "--max-total-tokens", "2048", "--grammar-compile-timeout", "600",
        env={COMPILE_HOLD_ENV: str(hold)},
    )  # fmt: skip
    s.compile_hold = hold
    yield s
    s.stop()


def test_compiles_whose_clients_leave_are_ended_and_plain_requests_still_run(patient):
    async def leave_after_queueing() -> None:
        async with httpx.AsyncClient(base_url=patient.url, timeout=600) as h:
            sent = [
                asyncio.ensure_future(h.post("/v1/completions", json=big_enum_body(i)))
                for i in range(6)
            ]
            # Every compile is queued or running before the clients give up.
            in_flight = "tierserve_grammar_compiles_in_flight"
            await asyncio.to_thread(patient.wait_for, lambda m: m[in_flight] == 6, 120)
            for task in sent:
                task.cancel()
            await asyncio.gather(*sent, return_exceptions=True)

    asyncio.run(leave_after_queueing())
    patient.wait_for(lambda m: m[ENDED % "client_left"] == 6)
    body = {"prompt": "Once upon", "max_tokens": 8}
    reply = http.post(f"{patient.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    m = patient.metrics()
    assert m[ENDED % "client_left"] == 6 and m["tierserve_grammar_compiles_in_flight"] == 0
    assert eventually(
        lambda: not compile_workers(patient), 10
    )  # the one that was compiling was killed, not left to run
    # The pool still compiles for the next client.
    ok = {"prompt": "A", "max_tokens": 8, "response_format": {"type": "json_object"}}
    assert http.post(f"{patient.url}/v1/completions", json=ok, timeout=120).status_code == 200


def test_a_compile_past_its_time_limit_is_a_400_and_its_process_is_gone(llama_dir):
    s = Server(llama_dir, "--max-total-tokens", "2048", "--grammar-compile-timeout", "0.001")
    try:
        reply = http.post(f"{s.url}/v1/completions", json=big_enum_body(0), timeout=120)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert "--grammar-compile-timeout" in error["message"]
        assert error["param"] == "json_schema"
        m = s.metrics()
        assert m[ENDED % "timeout"] > 0 and m["tierserve_grammar_compile_workers"] == 0
        assert eventually(lambda: not compile_workers(s), 10)
        assert http.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput("regex", "a" * (MAX_GRAMMAR_CHARS + 1)), "characters is over"),
        (
            StructuredOutput.json({"enum": list(range(MAX_SCHEMA_ENUM_VALUES + 1))}),
            "enum values, over",
        ),
        (StructuredOutput("json_schema", '{"a":' * 200 + "1" + "}" * 200), "levels deep"),
        (StructuredOutput("json_schema", "[" * 100_000 + "]" * 100_000), "nests"),
    ],
)
def test_grammars_past_the_documented_limits_are_refused_before_compiling(llama_dir, spec, says):
    llm = LLM(str(llama_dir), max_total_tokens=1024)
    with pytest.raises(TierserveError, match=says):
        llm.generate("A", SamplingParams(max_tokens=2, structured_output=spec))
    assert llm.engine.grammars._compiler is None  # nothing was compiled, not even the compiler


@pytest.mark.parametrize("kind", ["builtin_structural_tag", "structural_tag"])
def test_the_limits_hold_for_the_schemas_inside_a_tag(kind):
    """A tag holds its schemas inside (a tool family's format: one per tool): they count
    against the limits as a json_schema's do."""
    enum = {"type": "object", "properties": {"a": {"enum": list(range(MAX_SCHEMA_ENUM_VALUES))}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": enum}}
             for i in range(2)]  # fmt: skip
    source = {"model": "qwen_3", "tools": tools, "tool_choice": "required"}
    with pytest.raises(TierserveError, match="enum values, over") as err:
        check_size(StructuredOutput(kind, json.dumps(source)))
    assert err.value.field == kind


def test_the_limits_reach_http_clients_as_400s(patient):
    schema = {"enum": list(range(MAX_SCHEMA_ENUM_VALUES + 1))}
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
    body = {"prompt": "A", "max_tokens": 2, "response_format": rf}
    reply = http.post(f"{patient.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "enum values" in reply.json()["error"]["message"]


# --- workers that die -------------------------------------------------------------------------


def _held_worker(server: Server, not_pids: set[int]) -> int:
    """The pid of a compile worker now held before its compile (not one of `not_pids`)."""
    found: list[int] = []

    def held() -> bool:
        pids = {int(p.name.rsplit(".", 1)[1]) for p in server.compile_hold.parent.glob("*.held.*")}
        found[:] = sorted(pids - not_pids)
        return bool(found)

    assert eventually(held, 120), "no compile worker took the job"
    return found[0]


def _regex_request(server: Server, regex: str) -> httpx.Response:
    body = {"prompt": "A", "max_tokens": 3, "regex": regex}
    return http.post(f"{server.url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_worker_killed_during_a_compile_is_retried_once_then_a_503(patient, deaths):
    """Held in its worker (the test's hold), the compile's process is killed: once, the request
    is compiled again on a fresh worker and answered; twice, it is a 503 that says the server
    failed. Never a 500 or a 400; the pool serves the next compile."""
    patient.compile_hold.touch()
    killed: set[int] = set()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_regex_request, patient, f"[a-c]{{{deaths + 3}}}")
        try:
            for _ in range(deaths):
                pid = _held_worker(patient, killed)
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            if deaths == 1:
                _held_worker(patient, killed)  # the retry's worker took the job
        finally:
            patient.compile_hold.unlink()
        status = reply.result(timeout=120).status_code
    for held in patient.compile_hold.parent.glob("*.held.*"):
        held.unlink()
    assert status == (200 if deaths == 1 else 503)
    assert _regex_request(patient, f"[x-z]{{{deaths}}}").status_code == 200


def test_a_worker_killed_between_compiles_costs_the_next_request_nothing(patient):
    assert _regex_request(patient, "[a-b]{2}").status_code == 200  # a worker, now idle
    for worker in compile_workers(patient):
        worker.send_signal(signal.SIGKILL)
    assert eventually(lambda: not compile_workers(patient), 30)
    reply = _regex_request(patient, "[d-f]{3}")
    assert reply.status_code == 200, reply.text


def test_sigterm_ends_compiles_in_flight_with_a_503_and_exits_cleanly(patient):
    """A compile holds no shutdown: SIGTERM ends it (starting or running), its client gets a
    503 (not a 500 or a traceback), and the server exits without waiting for the compile's
    time limit. The module's last test: it ends the module's server."""
    s = patient
    try:

        async def compile_then_term() -> int:
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as h:
                sent = asyncio.ensure_future(h.post("/v1/completions", json=big_enum_body(7)))
                in_flight = "tierserve_grammar_compiles_in_flight"
                await asyncio.to_thread(s.wait_for, lambda m: m[in_flight] == 1, 120)
                s.proc.send_signal(signal.SIGTERM)
                return (await sent).status_code

        assert asyncio.run(compile_then_term()) == 503
        assert s.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        log = s.log_tail(10**6)
        assert "Traceback" not in log and "CancelledError" not in log
    finally:
        s.stop()
