"""tierserve as a worker of the real sglang-router (`smg launch`): the router's worker discovery
finds SGLang's info endpoints, requests sent to the router come back from the workers, workers
join, leave and die under it, and what cache-aware routing and a shared store buy in hit rate."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import tierserve
from tests.conftest import Server, eventually, http
from tierserve.bench.client import LoadOptions, run_load
from tierserve.bench.metrics import summarize
from tierserve.bench.replicas import ROUTER_POLICIES, ReplicaLayout, ReplicaSet, Router
from tierserve.bench.workloads import TokenSpace, Workload, multiturn

DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
FLAGS = ("--max-total-tokens", "16384", "--device", "cpu")  # each holds the bench's workload


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Server, Server]]:
    """Two replicas for the module's tests; the last one kills the first."""
    with Server(DEMO_DIR, *FLAGS) as a, Server(DEMO_DIR, *FLAGS) as b:
        yield a, b


@pytest.mark.parametrize(
    "name", ["replicas-0-round_robin", "replicas-\u00b2-round_robin", "replicas-2-nope"]
)
def test_a_replicas_configuration_that_does_not_parse_is_refused_by_name(name):
    """A count int() cannot read (the superscript two is a digit to str.isdigit) included."""
    with pytest.raises(tierserve.TierserveError, match="bad replicas configuration"):
        ReplicaLayout.parse(name)
    assert ReplicaLayout.parse("replicas-2-round_robin-store") == ReplicaLayout(
        2, "round_robin", True
    )


def test_tierserve_workers_behind_sglang_router(tmp_path, pair):
    a, b = pair
    for worker in (a, b):  # what the router reads when a worker joins, as SGLang has it
        info = http.get(f"{worker.url}/get_server_info").json()
        assert info["model_path"] == str(DEMO_DIR) and info["dp_size"] == 1
        model = http.get(f"{worker.url}/model_info").json()
        assert model["architectures"] == ["LlamaForCausalLM"] and model["is_generation"]
    for policy in ROUTER_POLICIES:  # power_of_two also polls the workers' /get_load
        router = Router([a.url, b.url], policy, tmp_path / f"{policy}.log")
        try:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
            before = sum(_served(w) for w in (a, b))
            reply = client.chat.completions.create(
                model=DEMO_DIR.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content is not None
            assert sum(_served(w) for w in (a, b)) > before, policy
            assert _generate(router.url, 1).json()["meta_info"]["completion_tokens"] == 3
        finally:
            router.stop()
    for worker in (a, b):  # the router found every endpoint it asked for
        assert " 404 " not in worker.log_tail(10**6)


def test_load_and_generating_health_answer_as_sglangs(pair):
    server = pair[0]
    assert http.post(f"{server.url}/flush_cache", timeout=30).is_success  # no KV held
    (idle,) = http.get(f"{server.url}/get_load").json()
    assert idle == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    before = _served(server)
    assert http.get(f"{server.url}/health_generate", timeout=60).json() == {"status": "ok"}
    assert _served(server) == before + 1  # it generated a token
    server.hold_steps(1)  # the next request's prefill runs, then the engine waits
    pending = concurrent.futures.ThreadPoolExecutor(1).submit(_generate, server.url, 2)
    try:
        server.wait_for(lambda m: m["tierserve_num_requests_running"] == 1)
        (held,) = http.get(f"{server.url}/get_loads").json()
        assert held["num_reqs"] == 1 and held["num_tokens"] >= 40
    finally:
        server.release_steps()
    assert pending.result(timeout=60).status_code == 200


# --- replicas that come, go and die -----------------------------------------------------------


def _served(worker: Server) -> float:
    return worker.metrics()["tierserve_generation_tokens_total"]


def _generate(url: str, seed: int) -> httpx.Response:
    """A /generate with token ids, as the bench sends: the router routes on them."""
    ids = [3 + (seed * 7 + i) % 300 for i in range(40)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    return http.post(f"{url}/generate", json=body, timeout=60)


def test_workers_join_and_leave_the_router(tmp_path, pair):
    a, b = pair
    router = Router([a.url], "round_robin", tmp_path / "router.log")
    try:
        added = http.post(f"{router.url}/workers", json={"url": b.url}, timeout=10)
        assert added.status_code == 202, added.text
        both = lambda: sum(w["is_healthy"] for w in router.workers()) == 2  # noqa: E731
        assert eventually(both, 60), router.workers()
        for i in range(6):  # round robin over both
            assert _generate(router.url, i).status_code == 200
        assert _served(a) > 0 and _served(b) > 0
        (a_id,) = [w["id"] for w in router.workers() if w["url"] == a.url]
        assert httpx.delete(f"{router.url}/workers/{a_id}", timeout=10).is_success
        assert eventually(lambda: [w["url"] for w in router.workers()] == [b.url], 60)
        before = _served(a), _served(b)
        for i in range(4):
            assert _generate(router.url, 10 + i).status_code == 200
        assert _served(a) == before[0] and _served(b) > before[1]
    finally:
        router.stop()


# --- what routing and a shared store buy, driven by the bench ---------------------------------


def _multiturn() -> Workload:
    space = TokenSpace(4096, 3)
    return multiturn(space, clients=6, rounds=3, request_length=300, output_length=8,
                     sub_question_length=40, seed=3)  # fmt: skip


def _outputs(result) -> dict[tuple[int, int], list[int]]:
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    return {(r.client, r.round): r.output_ids for r in result.records}


def test_routing_and_a_shared_store_keep_one_servers_hit_rate(tmp_path, pair):
    """Two replicas behind the real router: cache_aware keeps the hit rate of one server that
    holds everything and beats round robin; with one Mooncake Store shared, round robin reaches
    it too once the store holds the workload (writes drained, caches flushed, a second pass).
    Every configuration's greedy outputs equal the single server's."""
    wl = _multiturn()
    opts = LoadOptions(max_in_flight=4)  # the bench flushes every cache before each run
    a, b = pair
    single = run_load(a.url, wl, opts)
    runs = {}
    for policy in ("cache_aware", "round_robin"):
        router = Router([a.url, b.url], policy, tmp_path / f"{policy}.log")
        try:
            runs[policy] = run_load(router.url, wl, opts)
        finally:
            router.stop()
    layout = ReplicaLayout.parse("replicas-2-round_robin-store")
    with ReplicaSet(str(DEMO_DIR), layout, list(FLAGS), tmp_path / "logs", "store") as replicas:
        run_load(replicas.url, wl, opts)
        assert replicas.drain_writes()
        runs["round_robin-store"] = run_load(replicas.url, wl, opts)
    ceiling = summarize(single)["hit_rate"]
    rates = {name: summarize(result)["hit_rate"] for name, result in runs.items()}
    assert ceiling > 0.3
    assert rates["cache_aware"] >= 0.9 * ceiling, (rates, ceiling)
    assert rates["cache_aware"] > rates["round_robin"], rates
    assert rates["round_robin-store"] >= 0.9 * ceiling, (rates, ceiling)
    for name, result in runs.items():
        assert _outputs(result) == _outputs(single), name


def test_a_killed_replica_is_routed_around(tmp_path, pair):
    """SIGKILL of one replica's server (its core dies with it): once the router's health check
    marks it down, requests complete on the other one, and none hangs."""
    a, b = pair  # the module's last test: a does not come back
    flags = ["--health-check-interval-secs", "1", "--cb-failure-threshold", "1"]
    router = Router([a.url, b.url], "round_robin", tmp_path / "router.log", flags)
    try:
        assert _generate(router.url, 0).status_code == 200
        a.proc.kill()
        a.proc.wait(timeout=30)

        def a_down() -> bool:
            return not any(w["is_healthy"] for w in router.workers() if w["url"] == a.url)

        assert eventually(a_down, 60), router.workers()
        before = _served(b)
        replies = [_generate(router.url, 1 + i) for i in range(6)]
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        assert _served(b) > before
    finally:
        router.stop()
