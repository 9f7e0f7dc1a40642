"""The OpenAI-client tests, again against a server with --tp-size 2 (two rank processes over
gloo), compared with the same one-process offline engine. The tests are test_server.py's,
test_choices.py's, test_logprobs.py's and test_structured_output.py's that talk to the shared
server; pytest collects them here a second time with this module's `server`, which overrides
conftest's."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest

from tests.conftest import Server, http, maps_library
from tests.test_choices import (  # noqa: F401
    test_chat_takes_n,
    test_streamed_choices_carry_their_index,
)
from tests.test_logprobs import (  # noqa: F401
    test_echo_returns_the_prompt_and_its_logprobs_streamed_and_not,
    test_openai_shapes_streamed_and_not,
)
from tests.test_server import (  # noqa: F401
    test_64_concurrent_streams_match_offline_greedy,
    test_aborted_streams_free_their_kv,
    test_bad_values_are_400_and_the_engine_keeps_serving,
    test_chat_uses_the_template_and_streams_usage,
    test_completion_matches_offline_and_reports_usage,
    test_context_length_error_states_the_limit,
    test_invalid_requests_are_400,
    test_metrics_parse_and_move,
    test_native_generate_takes_token_ids,
    test_stop_strings_are_not_emitted,
    test_unknown_model_is_404_and_bad_json_400,
    test_without_max_tokens_a_request_runs_to_the_context_end,
)
from tests.test_structured_output import (  # noqa: F401
    test_regex_in_completions_streamed_and_not,
    test_response_format_json_schema_streamed_and_not,
)


@pytest.fixture(scope="module")
def server(llama_dir) -> Iterator[Server]:
    flags = ("--max-total-tokens", "4096", "--body-timeout", "2", "--tp-size", "2")
    s = Server(llama_dir, *flags, "--device", "cpu")  # gloo: one GPU per rank is not assumed
    yield s
    s.stop()


def test_the_api_process_of_a_tp_server_loads_no_torch(server):
    """Its ranks compute; the API process only reads HTTP and text. It once imported torch to
    learn its own rank before it spawned the engine core, which delayed the core by ~2 s."""
    body = {"model": "llama", "prompt": "hello", "max_tokens": 2}
    assert http.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert not maps_library(psutil.Process(server.proc.pid), "libtorch")
