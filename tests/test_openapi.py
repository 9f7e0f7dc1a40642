"""Schemathesis against the server's own /openapi.json: generated requests to every route,
fitting the schema and not, with a bounded example count. The one check is that no answer is a
5xx (the engine stays up here, so not even a 503). Our 400s differ from FastAPI's declared 422s
on purpose (OpenAI's error JSON), so schema conformance is not checked."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import Server


@pytest.fixture(scope="module")
def server(llama_dir) -> Iterator[Server]:
    # A short context keeps each generated request to a few steps.
    s = Server(llama_dir, "--max-total-tokens", "1024", "--context-length", "96")
    yield s
    s.stop()


def test_no_generated_request_gets_a_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6  # completions, chat, generate, models, health, flush, metrics
    errors: list[tuple[str, int, str]] = []
    calls = 0

    for operation, mode in itertools.product(operations, GenerationMode):

        @settings(
            max_examples=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case) -> None:
            nonlocal calls
            response = case.call(timeout=60)
            calls += 1
            if response.status_code >= 500:
                errors.append((case.operation.label, response.status_code, response.text[:300]))

        try:
            call()
        except Unsatisfiable:  # a route without inputs has no invalid request to make
            assert mode is GenerationMode.NEGATIVE
    assert calls > 150
    assert errors == []
