"""Data-parallel attention on CPU over gloo, with real rank processes: greedy outputs equal one
process for Llama (GQA) and DeepSeek-V3 (MLA + MoE) at tp 2 / dp 2 and tp 4 / dp 2 with the
radix cache and the host tier on; at the same pool bytes per rank an MLA model runs twice the
requests at once; the dispatcher's rules; a served DP engine answers the openai client, flushes
every group and goes down with a rank."""

from __future__ import annotations

import signal
import threading

import openai
import pytest

from tests.conftest import Server, eventually, http, random_prompts, running
from tests.test_hicache import mixed_workload, mixed_workload_reference
from tests.test_tp import _ranks_of
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.args import EngineArgs, default_model
from tierserve.bench.client import parse_prometheus
from tierserve.engine import engine_metrics
from tierserve.engine.dispatch import BALANCE_ABS, BLOCK, Dispatcher
from tierserve.engine.startup import weight_sizes
from tierserve.sampling_params import StructuredOutput
from tierserve.server.metrics import ServerMetrics

HOST = dict(
    device="cpu",
    max_total_tokens=480,
    chunked_prefill_size=128,
    enable_hierarchical_cache=True,
    hicache_ratio=8,
)
DP = dict(enable_dp_attention=True)
YES_NO = StructuredOutput("regex", "(yes|no)")


def metrics_of(llm: LLM) -> dict[str, float]:
    """The engine's families as /metrics renders them."""
    return parse_prometheus(ServerMetrics().render(engine_metrics(llm.engine)).decode())


@pytest.fixture(scope="module")
def references(checkpoints, run_dir) -> dict[str, list[list[int]]]:
    families = ("llama", "deepseek-v3")
    return {f: mixed_workload_reference(run_dir, checkpoints[f], **HOST) for f in families}


@pytest.mark.parametrize(
    ("family", "tp", "dp"),
    [("llama", 2, 2), ("deepseek-v3", 2, 2), ("llama", 4, 2), ("deepseek-v3", 4, 2)],
)
def test_greedy_outputs_equal_one_process(checkpoints, references, family, tp, dp):
    with LLM(str(checkpoints[family]), tp_size=tp, dp_size=dp, **DP, **HOST) as llm:
        assert mixed_workload(llm) == references[family]
        engine = llm.engine
        # The workload's shared prefix stays on one group, so its host tier serves it again.
        stats = engine.kv.host.stats
        assert stats.host_hit_tokens > 0 and stats.load_backs > 0
        assert engine.scheduler.stats.num_cached_tokens > 0
        metrics = metrics_of(llm)
        placed = [metrics[f"tierserve_dp_requests_placed_total{{dp_rank={g}}}"] for g in range(dp)]
        idle = [metrics[f"tierserve_dp_idle_steps_total{{dp_rank={g}}}"] for g in range(dp)]
        assert all(placed) and placed[0] != placed[1]  # both groups ran, unevenly
        assert any(idle)  # and a group joined steps with nothing of its own to run
        # Each group's KV is split over its tp / dp ranks: its pool holds its heads only.
        assert engine.kv_plan.spec.tp == tp // dp
        # The sizes count the attention side once per group: close to what rank 0 holds (the
        # rest are the parts a group's ranks keep whole: norms, routers, MLA's latent
        # projections, counted as split).
        held = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        _, _, rank = weight_sizes(
            engine.args, engine.startup.model_path, engine.model_config, engine.device,
            engine.dtype,
        )  # fmt: skip
        assert rank == pytest.approx(held, rel=0.1)


def test_write_back_and_offload_preemption_under_dp_attention(checkpoints, references):
    """The host tier's other policy, and a request offloaded to make room, in a group."""
    path = str(checkpoints["llama"])
    kw = dict(tp_size=2, dp_size=2, hicache_write_policy="write_back", **DP, **HOST)
    with LLM(path, **kw) as llm:
        assert mixed_workload(llm) == references["llama"]
        assert llm.engine.scheduler.stats.num_offload_preemptions > 0
        assert llm.engine.kv.host.stats.host_written_tokens > 0


def test_logprobs_grammars_and_choices_equal_one_process_under_dp_attention():
    """The demo model (a real tokenizer) at tp 2 / dp 2: logprobs, prompt logprobs, a regex
    grammar and seeded samples, against one process."""
    jobs = [
        ("the code is", SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1)),
        ("say yes or no:", SamplingParams(max_tokens=6, temperature=0, structured_output=YES_NO)),
        ("once upon a time", SamplingParams(max_tokens=6, temperature=1.0, seed=5)),
        ("once upon a time", SamplingParams(max_tokens=6, temperature=1.0, seed=6)),
    ]
    demo = default_model()

    def run(**kw) -> list:
        with LLM(demo, device="cpu", max_total_tokens=2048, **kw) as llm:
            return [llm.generate(prompt, params)[0] for prompt, params in jobs]

    want = run()
    got = run(tp_size=2, dp_size=2, **DP)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.text == w.text
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in w.logprobs], abs=1e-4
        )
        assert [lp.logprob for lp in g.prompt_logprobs or []] == pytest.approx(
            [lp.logprob for lp in w.prompt_logprobs or []], abs=1e-4
        )
    assert got[1].text in ("yes", "no")


def _held_running(model, n: int, *flags: str) -> tuple[int, int]:
    """Serve `model`, send `n` long streams while no step may run, then let three steps run:
    the peak of requests running at once (/metrics) and the node's distinct device tokens then
    in use. The streams are closed (aborted) afterwards."""
    with Server(model, "--device", "cpu", "--max-total-tokens", "320", *flags) as server:
        server.hold_steps(0)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        done = threading.Event()

        def stream(prompt: list[int]) -> None:
            chunks = client.completions.create(
                model=model.name, prompt=prompt, max_tokens=250, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            with chunks:
                for _ in chunks:
                    if done.is_set():
                        return  # closing the stream aborts the request

        threads = [threading.Thread(target=stream, args=(p,)) for p in random_prompts(n, [40])]
        for t in threads:
            t.start()
        server.wait_for(lambda m: _arrived(m) == n)  # every one queued, none run yet
        server.hold_steps(3)
        server.wait_for(lambda m: m["tierserve_engine_steps_total"] == 3)
        metrics = server.metrics()
        done.set()
        server.release_steps()
        for t in threads:
            t.join(timeout=60)
        peak = int(metrics["tierserve_peak_requests_running"])
        if "tierserve_dp_size" in metrics:
            used = sum(v for k, v in metrics.items() if k.startswith("tierserve_dp_device_tok"))
        else:  # every rank holds the same tokens: one rank's pool is the node's distinct KV
            used = metrics["tierserve_kv_pages_used{tier=device}"] * 16
        return peak, int(used)


def _arrived(m: dict[str, float]) -> float:
    """Requests the engine core has taken: placed on the groups, or waiting in its queue."""
    placed = [v for k, v in m.items() if k.startswith("tierserve_dp_requests_placed_total")]
    return sum(placed) if placed else m["tierserve_num_requests_waiting"]


def test_dp_attention_runs_twice_the_requests_at_the_same_pool_bytes(checkpoints):
    """MLA at tp 2: plain TP holds the same latents on both ranks; with two attention groups
    each rank's pool (the same bytes) holds its own group's requests."""
    model = checkpoints["deepseek-v3"]
    tp_peak, tp_tokens = _held_running(model, 24, "--tp-size", "2")
    dp_flags = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    dp_peak, dp_tokens = _held_running(model, 24, *dp_flags)
    assert 0 < tp_peak < 12 and dp_peak == 2 * tp_peak, (tp_peak, dp_peak)
    assert dp_tokens == 2 * tp_tokens > 0, (tp_tokens, dp_tokens)


def _multiturn_hits(model, *flags: str, clients: int = 5, rounds: int = 3) -> list[int]:
    """Cached prompt tokens per round of a multi-turn chat through the server's /generate
    (each turn's prompt is the conversation so far, as token ids), as the server reports them."""
    convs = random_prompts(clients, [100], seed=7)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    hits = []
    with Server(model, "--device", "cpu", "--max-total-tokens", "4096", *flags) as server:
        for r in range(rounds):
            cached = 0
            for i, conv in enumerate(convs):
                body = {"input_ids": conv, "sampling_params": params}
                out = http.post(f"{server.url}/generate", json=body, timeout=60).json()
                cached += out["meta_info"]["cached_tokens"]
                question = random_prompts(1, [8], seed=100 * r + i)[0]
                convs[i] = conv + out["output_ids"] + question
            hits.append(cached)
    return hits


def test_prefix_affinity_keeps_a_conversation_on_its_group(checkpoints):
    """Every round after the first hits at least 90% of what one group holding every
    conversation hits; round robin (5 conversations over 2 groups) moves them and hits less."""
    model = checkpoints["llama"]
    one_group = _multiturn_hits(model)
    dp = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    affinity = _multiturn_hits(model, *dp)
    rotating = _multiturn_hits(model, *dp, "--load-balance-method", "round_robin")
    assert one_group[0] == affinity[0] == 0 and min(one_group[1:]) > 0
    for r in range(1, len(one_group)):
        assert affinity[r] >= 0.9 * one_group[r], (affinity, one_group)
    assert sum(rotating[1:]) < sum(affinity[1:]), (rotating, affinity)


# --- the dispatcher -------------------------------------------------------------------------


def test_cache_aware_sends_a_conversations_next_turn_to_its_prefix():
    d = Dispatcher(2)
    a, b = random_prompts(2, [64], seed=1)
    assert d.place("a", a) == 0 and d.place("b", b) == 1  # no prefix: the smallest tree
    d.finished("a")
    d.finished("b")
    assert d.place("b2", b + [5] * 20) == 1 and d.place("a2", a + [7] * 20) == 0


def test_cache_aware_yields_to_balance_and_round_robin_ignores_prefixes():
    d = Dispatcher(2)
    (hot,) = random_prompts(1, [64], seed=2)
    for i in range(BALANCE_ABS + 1):  # one hot prefix piles up on its group
        assert d.place(f"hot-{i}", hot + [i + 2] * BLOCK) == 0
    assert d.place("one-more", hot + [999] * BLOCK) == 1  # out of balance: the idle group
    rr = Dispatcher(2, "round_robin")
    assert [rr.place(f"r{i}", hot + [i + 2] * BLOCK) for i in range(4)] == [0, 1, 0, 1]


def test_prompts_too_short_to_index_go_to_the_least_loaded_group():
    d = Dispatcher(2)
    short = random_prompts(4, [BLOCK - 1], seed=4)
    assert [d.place(f"s{i}", p) for i, p in enumerate(short)] == [0, 1, 0, 1]


def test_a_requests_choices_share_one_group():
    d = Dispatcher(2, "round_robin")
    (p,) = random_prompts(1, [40], seed=3)
    assert {d.place(f"x-{i}", p) for i in range(4)} == {0}  # the same prompt in flight
    for i in range(4):
        d.finished(f"x-{i}")
    assert d.place("y", p) == 1  # none in flight: the rule again


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(tp_size=2, dp_size=2), "behind sglang-router"),
        (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "must divide --tp-size"),
        (dict(tp_size=2, enable_dp_attention=True), "needs --dp-size > 1"),
        (
            dict(tp_size=2, dp_size=2, **DP, load_balance_method="follow_bootstrap_room"),
            "prefill-decode",
        ),
    ],
)
def test_dp_flags_are_checked_with_sglangs_rules(kwargs, needle):
    with pytest.raises(TierserveError, match=needle):
        EngineArgs(**kwargs)


# --- served ---------------------------------------------------------------------------------


def test_a_dp_server_answers_flushes_every_group_and_goes_down_with_a_rank(llama_dir):
    prompts = random_prompts(4, [30], seed=5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(llama_dir), device="cpu", max_total_tokens=480) as llm:
        want = [o.text for o in llm.generate(prompts, params)]
    flags = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--device", "cpu")
    server = Server(llama_dir, *flags, "--max-total-tokens", "480")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        kw = dict(model=llama_dir.name, max_tokens=6, temperature=0)
        kw["extra_body"] = {"ignore_eos": True}
        texts = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
        assert texts == want
        many = client.completions.create(prompt=prompts[0], n=3, seed=1, **{**kw, "temperature": 1})
        assert [c.index for c in many.choices] == [0, 1, 2]
        metrics = server.metrics()
        assert metrics["tierserve_dp_size"] == 2
        placed = [metrics[f"tierserve_dp_requests_placed_total{{dp_rank={g}}}"] for g in (0, 1)]
        assert all(placed) and sum(placed) == len(prompts) + 3
        assert metrics["tierserve_dp_device_tokens_used{dp_rank=1}"] > 0  # the radix cache
        flushed = http.post(f"{server.url}/flush_cache", timeout=60).json()
        assert flushed["flushed_pages"] > 0
        metrics = server.metrics()
        assert [metrics[f"tierserve_dp_device_tokens_used{{dp_rank={g}}}"] for g in (0, 1)] == [
            0,
            0,
        ]  # every group flushed

        core = server.core
        (rank1,) = _ranks_of(server.proc.pid)
        rank1.send_signal(signal.SIGKILL)
        body = {"model": llama_dir.name, "prompt": prompts[0], "max_tokens": 10}
        status = http.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code
        assert status == 503
        assert server.proc.wait(timeout=30) != 0  # it exits for its supervisor, never hangs
        assert eventually(lambda: not running(core.pid), 10)  # no process left behind
    finally:
        server.stop()
