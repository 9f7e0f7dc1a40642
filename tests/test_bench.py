"""`tierserve bench`: metrics on synthetic timelines, workload generators, the load generator's
schedules, and an end-to-end run against real servers started here."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from tierserve.bench import client as bench_client
from tierserve.bench import compare as cmp
from tierserve.bench import workloads as w
from tierserve.bench.client import LoadOptions, RequestRecord, RunResult, run_load
from tierserve.bench.metrics import distribution, summarize, tier_hit_rates
from tierserve.cli import main as cli_main
from tierserve.errors import TierserveError

SPACE = w.TokenSpace(vocab_size=320)


def rec(send, chunks, out_tokens, *, rnd=0, prompt=100, cached=None, end=None) -> RequestRecord:
    return RequestRecord(
        index=0,
        client=0,
        round=rnd,
        group=0,
        prompt_len=prompt,
        max_tokens=out_tokens,
        send=send,
        chunk_times=list(chunks),
        end=(chunks[-1] if chunks else None) if end is None else end,
        prompt_tokens=prompt,
        output_tokens=out_tokens,
        cached_tokens=cached,
    )


def result(records, before=None, after=None) -> RunResult:
    return RunResult("http://x", {}, {}, 0.0, 0.0, records, before, after)


# --- metrics ------------------------------------------------------------------------------


def test_distribution_matches_numpy_linear_percentiles():
    d = distribution(range(1, 101))
    assert d == pytest.approx(
        {"count": 100, "mean": 50.5, "median": 50.5, "p90": 90.1, "p99": 99.01}
    )
    assert distribution([2.0]) == {"count": 1, "mean": 2.0, "median": 2.0, "p90": 2.0, "p99": 2.0}
    assert distribution([])["mean"] is None


def test_ttft_tpot_itl_e2e_on_a_synthetic_timeline():
    a = rec(1.0, [1.5, 1.7, 2.0, 2.6], 4, cached=0)  # TTFT .5, E2E 1.6, TPOT 1.1/3
    b = rec(2.0, [2.25, 3.25], 5, cached=50, end=3.5)  # TTFT .25, E2E 1.5, TPOT 1.25/4
    s = summarize(result([a, b]))
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["ttft_s"]["mean"] == pytest.approx(0.375)
    assert s["ttft_s"]["median"] == pytest.approx(0.375)
    assert s["e2e_s"]["mean"] == pytest.approx(1.55)
    assert s["tpot_s"]["mean"] == pytest.approx((1.1 / 3 + 1.25 / 4) / 2)
    # ITL: every gap between chunks, pooled: .2, .3, .6 from a and 1.0 from b
    assert s["itl_s"]["count"] == 4
    assert s["itl_s"]["mean"] == pytest.approx((0.2 + 0.3 + 0.6 + 1.0) / 4)
    assert s["itl_s"]["median"] == pytest.approx(0.45)
    assert s["itl_s"]["p90"] == pytest.approx(float(np.percentile([0.2, 0.3, 0.6, 1.0], 90)))
    # throughput over first send (1.0) -> last completion (3.5)
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["request_throughput"] == pytest.approx(2 / 2.5)
    assert s["input_throughput"] == pytest.approx(200 / 2.5)
    assert s["output_throughput"] == pytest.approx(9 / 2.5)
    assert s["hit_rate"] == pytest.approx(50 / 200)


def test_single_token_outputs_have_no_tpot_and_failures_are_counted():
    ok = rec(0.0, [0.4], 1)
    failed = rec(0.0, [], 3, end=None)
    failed.end, failed.error = None, "HTTP 500"
    s = summarize(result([ok, failed]))
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["tpot_s"]["count"] == 0 and s["itl_s"]["count"] == 0
    assert s["ttft_s"]["mean"] == pytest.approx(0.4)


def test_hit_rate_per_round_and_per_tier():
    records = [
        rec(0, [1], 2, rnd=0, prompt=100, cached=0),
        rec(0, [1], 2, rnd=0, prompt=100, cached=0),
        rec(2, [3], 2, rnd=1, prompt=150, cached=96),
        rec(2, [3], 2, rnd=1, prompt=150, cached=144),
    ]
    before = {
        "tierserve_prompt_tokens_total": 1000.0,
        "tierserve_cached_tokens_total{tier=device}": 100.0,
        "tierserve_cached_tokens_total{tier=host}": 0.0,
        "tierserve_load_back_tokens_total": 0.0,
    }
    after = {
        "tierserve_prompt_tokens_total": 1500.0,
        "tierserve_cached_tokens_total{tier=device}": 196.0,
        "tierserve_cached_tokens_total{tier=host}": 144.0,
        "tierserve_load_back_tokens_total": 144.0,
    }
    s = summarize(result(records, before, after))
    assert s["hit_rate"] == pytest.approx(240 / 500)
    by_round = {r["round"]: r for r in s["per_round"]}
    assert by_round[0]["hit_rate"] == 0.0
    assert by_round[1]["hit_rate"] == pytest.approx(240 / 300)
    assert by_round[1]["prompt_len_mean"] == 150
    tiers = s["per_tier"]
    assert tiers["hit_rate"] == pytest.approx({"device": 96 / 500, "host": 144 / 500})
    assert tiers["load_back_tokens"] == 144
    assert tier_hit_rates(None, after) is None  # not a tierserve server: no tiers


def test_hit_rate_is_none_when_the_server_reports_no_cached_tokens():
    assert summarize(result([rec(0, [1], 2, cached=None)]))["hit_rate"] is None


# --- workloads ----------------------------------------------------------------------------


def test_multiturn_lengths_prefixes_and_seeds():
    wl = w.multiturn(
        SPACE,
        clients=4,
        rounds=3,
        request_length=50,
        output_length=7,
        sub_question_length=9,
        seed=3,
    )
    assert wl.num_requests == 12 and wl.rounds == 3
    assert wl.kv_tokens() == 4 * (50 + 2 * 9 + 3 * 7)
    for conv in wl.conversations:
        assert len(conv.first) == 50 and [len(q) for q in conv.questions] == [9, 9]
        assert all(SPACE.low <= t < SPACE.vocab_size for t in conv.first)
        outputs = [[1000 + conv.client * 10 + r] * 7 for r in range(3)]
        prompts = [conv.prompt(r, outputs) for r in range(3)]
        for r, p in enumerate(prompts):
            assert len(p) == 50 + r * (7 + 9)  # L + r(O+S)
        for r in range(2):  # round r's prompt + its output is an exact prefix of round r+1's
            head = prompts[r] + outputs[r]
            assert prompts[r + 1][: len(head)] == head
    same = w.multiturn(SPACE, clients=4, rounds=3, request_length=50, output_length=7,
                       sub_question_length=9, seed=3)  # fmt: skip
    other = w.multiturn(SPACE, clients=4, rounds=3, request_length=50, output_length=7,
                        sub_question_length=9, seed=4)  # fmt: skip
    assert same.conversations == wl.conversations
    assert other.conversations[0].first != wl.conversations[0].first
    # clients do not share a prefix
    firsts = [c.first for c in wl.conversations]
    assert len({tuple(f[:4]) for f in firsts}) == 4
    # SGLang: sub-question length 0 means the request length
    sg = w.multiturn(SPACE, clients=1, rounds=2, request_length=20, output_length=2)
    assert len(sg.conversations[0].questions[0]) == 20


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    wl = w.shared_prefix(
        SPACE,
        groups=3,
        prompts_per_group=4,
        system_prompt_len=30,
        question_len=6,
        output_len=5,
        seed=1,
    )
    assert len(wl.requests) == 12
    assert all(len(r.prompt) == 36 and r.output_len == 5 for r in wl.requests)
    by_group: dict[int, list[list[int]]] = {}
    for r in wl.requests:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 4 for v in by_group.values())
    systems = set()
    for prompts in by_group.values():
        assert len({tuple(p[:30]) for p in prompts}) == 1
        assert len({tuple(p[30:]) for p in prompts}) == 4  # distinct questions
        systems.add(tuple(prompts[0][:30]))
    assert len(systems) == 3
    assert [r.group for r in wl.requests] != sorted(r.group for r in wl.requests)  # shuffled
    assert wl.kv_tokens() == 3 * 30 + 12 * 6 + 12 * 5
    again = w.shared_prefix(SPACE, groups=3, prompts_per_group=4, system_prompt_len=30,
                            question_len=6, output_len=5, seed=1)  # fmt: skip
    assert again.requests == wl.requests


@pytest.mark.parametrize(
    ("semantics", "ratio", "expected"),
    [
        ("sglang", 1.0, (100, 100)),
        ("sglang", 0.5, (50, 100)),
        ("sglang", 0.0, (1, 100)),
        ("vllm", 0.0, (100, 100)),
        ("vllm", 0.25, (75, 125)),
    ],
)
def test_random_length_ranges(semantics, ratio, expected):
    assert w.length_range(100, ratio, semantics) == expected
    wl = w.random_requests(
        SPACE,
        num_prompts=200,
        input_len=100,
        output_len=100,
        range_ratio=ratio,
        semantics=semantics,
        seed=7,
    )
    lo, hi = expected
    lens = [len(r.prompt) for r in wl.requests]
    outs = [r.output_len for r in wl.requests]
    assert min(lens) >= lo and max(lens) <= hi and min(outs) >= lo and max(outs) <= hi
    if hi - lo > 20:  # the range is actually used
        assert max(lens) - min(lens) > (hi - lo) // 2
    assert wl.params["input_range"] == [lo, hi]


def test_random_rejects_bad_ratios():
    with pytest.raises(TierserveError):
        w.length_range(100, 1.5, "sglang")
    with pytest.raises(TierserveError):
        w.length_range(100, 1.0, "vllm")
    with pytest.raises(TierserveError):
        w.length_range(100, 0.5, "other")


def test_trace_replay_keeps_block_sharing_and_scales(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 32, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 500, "output_length": 10, "hash_ids": [4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = w.trace(SPACE, path=path, num_requests=10, block_scale=1 / 16, length_scale=1 / 16,
                 time_scale=0.5, seed=2)  # fmt: skip
    a, b, c = wl.requests
    assert wl.params["block_tokens"] == 32
    assert [len(r.prompt) for r in (a, b, c)] == [94, 69, 31]  # round(len / 16)
    assert [r.output_len for r in (a, b, c)] == [4, 2, 1]
    assert [r.arrival for r in (a, b, c)] == pytest.approx([0.0, 0.25, 1.0])
    assert a.prompt[:64] == b.prompt[:64]  # hash ids 0, 1 -> the same two blocks
    assert a.prompt[64:69] != b.prompt[64:69]  # ids 2 and 3 differ
    again = w.trace(SPACE, path=path, num_requests=10, block_scale=1 / 16,
                    length_scale=1 / 16, time_scale=0.5, seed=2)  # fmt: skip
    assert again.requests == wl.requests
    # lengths scaled faster than blocks: the prompt is padded with tokens of its own
    long = w.trace(SPACE, path=path, num_requests=1, block_scale=1 / 64, length_scale=1 / 16)
    assert len(long.requests[0].prompt) == 94


def test_trace_clips_or_skips_what_the_context_cannot_hold(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1600, "output_length": 160, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 320, "output_length": 32, "hash_ids": [0]},
        {"timestamp": 2, "input_length": 320, "output_length": 2000, "hash_ids": [3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = w.trace(SPACE, path=path, block_scale=1 / 16, length_scale=1 / 16, context_length=64)
    assert (wl.params["clipped"], wl.params["skipped"]) == (1, 1)  # the third: output alone > 64
    first, second = wl.requests
    assert len(first.prompt) + first.output_len == 64 and first.output_len == 10
    assert len(second.prompt) == 20 and [r.index for r in wl.requests] == [0, 1]
    assert first.prompt[:20] == second.prompt  # the shared first block survives the clip


def test_trace_reads_the_mooncake_files_by_default():
    if not (w.TRACE_DIR / "conversation_trace.jsonl").exists():
        pytest.skip("shared/data/mooncake-traces is not in this checkout")
    wl = w.trace(SPACE, num_requests=20)
    assert len(wl.requests) == 20
    assert wl.requests[0].arrival == 0.0
    assert wl.requests[0].prompt[:16] == wl.requests[1].prompt[:16]  # both start with id 0
    with pytest.raises(TierserveError):
        w.trace(SPACE, path="no-such-trace")


# --- schedules (no server: the sender is replaced) ----------------------------------------


class FakeSender:
    def __init__(self, delay: float) -> None:
        self.delay, self.t0 = delay, None
        self.in_flight = self.peak = 0

    def now(self) -> float:
        import time

        if self.t0 is None:
            self.t0 = time.perf_counter()
        return time.perf_counter() - self.t0

    async def send(self, r: RequestRecord) -> RequestRecord:
        r.send = self.now()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        r.output_ids = [5] * r.max_tokens
        r.output_tokens = r.max_tokens
        r.chunk_times = [self.now()]
        r.end = self.now()
        return r


def test_bounded_in_flight_and_poisson_gaps():
    wl = w.random_requests(SPACE, num_prompts=40, input_len=10, output_len=2, seed=0)
    sender = FakeSender(0.02)
    opts = LoadOptions(max_in_flight=3)
    recs = asyncio.run(bench_client._run_requests(sender, wl.requests, opts, np_rng()))
    assert sender.peak == 3 and len(recs) == 40
    sender = FakeSender(0.0)
    opts = LoadOptions(request_rate=400.0)
    recs = asyncio.run(bench_client._run_requests(sender, wl.requests, opts, np_rng()))
    span = max(r.send for r in recs) - min(r.send for r in recs)
    # 39 exponential gaps of mean 2.5 ms (~0.1 s): sends wait for their arrival times. Only a
    # lower bound: a busy machine may be late, never early.
    assert span > 0.05


def np_rng():
    import random

    return random.Random(0)


def test_multiturn_round_barrier_and_history():
    wl = w.multiturn(SPACE, clients=4, rounds=3, request_length=10, output_length=2,
                     sub_question_length=3)  # fmt: skip
    sender = FakeSender(0.005)
    opts = LoadOptions(round_barrier=True, max_in_flight=2)
    recs = asyncio.run(bench_client._run_conversations(sender, wl.conversations, opts, np_rng()))
    assert len(recs) == 12 and sender.peak <= 2
    for k in (1, 2):
        prev_end = max(r.end for r in recs if r.round == k - 1)
        assert min(r.send for r in recs if r.round == k) >= prev_end
    for r in recs:
        assert r.prompt_len == 10 + r.round * (2 + 3)


# --- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench") / "server.log"
    s = cmp.ServerProcess(str(llama_dir), ["--max-total-tokens", "4096"], log)
    yield s
    s.stop()


def test_multiturn_against_a_real_server(server):
    page = 16
    wl = w.multiturn(SPACE, clients=3, rounds=2, request_length=40, output_length=6,
                     sub_question_length=8, seed=0)  # fmt: skip
    res = run_load(server.url, wl, LoadOptions(max_in_flight=3))
    s = summarize(res)
    assert s["completed"] == 6 and s["failed"] == 0
    by_client: dict[int, dict[int, RequestRecord]] = {}
    for r in res.records:
        by_client.setdefault(r.client, {})[r.round] = r
        assert r.output_tokens == 6 and len(r.output_ids) == 6
        assert r.prompt_tokens == r.prompt_len == 40 + r.round * 14
        assert 0 < r.first - r.send <= r.end - r.send
    for rounds in by_client.values():
        r0, r1 = rounds[0], rounds[1]
        head = r0.prompt + r0.output_ids  # the server's own output ids extend the history
        assert r1.prompt[: len(head)] == head
        # SGLang's multi-turn assertion: at least the full pages of prompt + output − 1
        assert r1.cached_tokens >= (r0.prompt_len + 6 - 1) // page * page
    by_round = {p["round"]: p for p in s["per_round"]}
    assert by_round[0]["hit_rate"] == 0.0
    assert by_round[1]["hit_rate"] > 0.5
    assert s["per_tier"]["hit_rate"]["device"] == pytest.approx(s["hit_rate"])
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert s[key]["mean"] > 0 and s[key]["p99"] >= s[key]["median"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0


def test_openai_backend_reports_usage(server, llama_dir):
    wl = w.shared_prefix(SPACE, groups=1, prompts_per_group=3, system_prompt_len=48,
                         question_len=4, output_len=3)  # fmt: skip
    opts = LoadOptions(backend="openai", max_in_flight=1)
    res = run_load(server.url, wl, opts)
    s = summarize(res)
    assert s["completed"] == 3
    assert all(r.prompt_tokens == 52 and r.output_tokens == 3 for r in res.records)
    assert sum(r.cached_tokens for r in res.records) >= 2 * 48 // 16 * 16
    with pytest.raises(TierserveError):  # multi-turn over openai needs a tokenizer
        run_load(server.url, w.multiturn(SPACE, clients=1, rounds=2, request_length=5,
                                         output_length=1), opts)  # fmt: skip
    opts = LoadOptions(backend="openai", tokenizer=str(llama_dir))
    mt = w.multiturn(SPACE, clients=2, rounds=2, request_length=30, output_length=4,
                     sub_question_length=5)  # fmt: skip
    assert summarize(run_load(server.url, mt, opts))["completed"] == 4


def test_compare_writes_json_report_and_plots(llama_dir, tmp_path):
    wl = w.multiturn(SPACE, clients=3, rounds=2, request_length=40, output_length=6,
                     sub_question_length=8, seed=1)  # fmt: skip
    sizing = cmp.size_pools(wl, page_size=16)
    assert sizing.device_tokens % 16 == 0 and sizing.device_tokens >= wl.max_request_tokens()
    assert sizing.limit_tokens >= 2 * wl.kv_tokens()
    configs = cmp.configurations(sizing, ["device-only", "write_back"])
    out = tmp_path / "results"
    path = cmp.compare(
        str(llama_dir), wl, LoadOptions(max_in_flight=3), configs, out, SPACE,
        meta={"title": "smoke", "command": "pytest"}, log=lambda *_: None, repeats=2,
    )  # fmt: skip
    assert path == out / "report.md"
    text = path.read_text()
    assert "device-only" in text and "write_back" in text and "## Machine" in text
    assert "## Repeats (2 per configuration" in text
    runs = sorted(p.name for p in (out / "runs").iterdir())  # the median repeat + the other
    assert len(runs) == 4 and "device-only.json" in runs and "write_back.json" in runs
    for png in ("ttft_per_round.png", "throughput.png", "hit_rate_by_tier.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["device-only", "write_back"]
    for name in ("device-only", "write_back"):
        run = json.loads((out / "runs" / f"{name}.json").read_text())
        assert len(run["records"]) == 6
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        assert [p["round"] for p in s["per_round"]] == [0, 1]
        assert s["request_throughput"] > 0 and s["ttft_s"]["mean"] > 0
    small, tiered = (r["summary"] for r in summary["runs"])
    # the small pool holds about a third of the histories; the host tier keeps the rest
    assert tiered["per_round"][1]["hit_rate"] > 0.5
    assert tiered["per_round"][1]["hit_rate"] > small["per_round"][1]["hit_rate"]
    assert "host" in tiered["per_tier"]["hit_rate"]
    assert tiered["per_tier"]["load_back_tokens"] > 0  # the hits came back from the host tier
    with pytest.raises(TierserveError):
        cmp.configurations(sizing, ["nonsense"])


def test_replica_configurations_name_their_layout():
    wl = w.multiturn(SPACE, clients=2, rounds=2, request_length=40, output_length=6)
    sizing = cmp.size_pools(wl, page_size=16)
    limit, rr, shared = cmp.configurations(
        sizing, ["limit", "replicas-2-round_robin", "replicas-4-cache_aware-store"]
    )
    assert limit.replicas is None and rr.flags == limit.flags  # each replica: limit's pool
    assert (rr.replicas.replicas, rr.replicas.policy, rr.replicas.shared_store) == (
        2, "round_robin", False,
    )  # fmt: skip
    assert (shared.replicas.replicas, shared.replicas.shared_store) == (4, True)
    assert "Mooncake" in shared.description
    for bad in ("replicas-0-round_robin", "replicas-2-fastest", "replicas-x-cache_aware"):
        with pytest.raises(TierserveError, match="replicas-N-POLICY"):
            cmp.configurations(sizing, [bad])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace-file", "TRACE"],
         "line 1 is not JSON"),
        (["run", "--url", "http://127.0.0.1:9", "--workload", "random", "--model", "BROKEN"],
         "gives no vocab_size"),
        (["compare", "--out", "OUT", "--device-fraction", "nan"],
         "--device-fraction must be in (0, 1]"),
        (["compare", "--out", "OUT", "--configs", ""], "--configs names no configuration"),
        (["compare", "--out", "OUT", "--server-args", '"unterminated'], "No closing quotation"),
        # A URL without a scheme was retried for ~15 s; a port past 65535 was a traceback.
        (["run", "--url", "notaurl"], "is not a server's URL"),
        (["run", "--url", "http://127.0.0.1:99999"], "is not a server's URL"),
        # -1 warm-up requests silently sent none; a negative seed was numpy's traceback.
        (["run", "--url", "http://127.0.0.1:9", "--warmup-requests", "-1"],
         "--warmup-requests must be >= 0, got -1"),
        (["run", "--url", "http://127.0.0.1:9", "--seed", "-1"], "--seed must be >= 0"),
        (["run", "--url", "http://127.0.0.1:9", "--timeout", "nan"], "timeout must be > 0 s"),
        # The whole run went first, and its results were lost where they could not be written.
        (["run", "--url", "http://127.0.0.1:9", "--out", "FILE/out"], "cannot write --out"),
        (["compare", "--out", "FILE"], "cannot write --out"),
    ],
)  # fmt: skip
def test_bad_files_and_values_exit_2_with_one_line(tmp_path, capsys, args, words):
    """Each raised a traceback (exit 1): a trace line that is not JSON, a model whose config
    does not parse, a NaN fraction, no configuration, an unclosed quote."""
    (tmp_path / "trace.jsonl").write_text("not json\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{oops")
    paths = {"TRACE": str(tmp_path / "trace.jsonl"), "BROKEN": str(tmp_path / "broken"),
             "OUT": str(tmp_path / "out"), "FILE": str(tmp_path / "trace.jsonl")}  # fmt: skip
    paths["FILE/out"] = paths["FILE"] + "/out"
    rc = cli_main(["bench", *(paths.get(a, a) for a in args)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert words in err.strip().splitlines()[-1]


def test_batch_output_that_cannot_be_written_exits_2_before_any_request(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "hi"}}) + "\n")  # fmt: skip
    rc = cli_main(["batch", str(src), "-o", str(tmp_path / "nowhere" / "out.jsonl"),
                   "--url", "http://127.0.0.1:9"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write --output" in err and "Traceback" not in err, err


@pytest.mark.parametrize("url", ["notaurl", "http://127.0.0.1:99999", "https://h:0"])
def test_batch_refuses_a_url_that_names_no_server_before_any_request(tmp_path, capsys, url):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "hi"}}) + "\n")  # fmt: skip
    rc = cli_main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--url", url])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a server's URL" in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_bad_input_exits_2(capsys):
    rc = cli_main(["bench", "run", "--url", "http://127.0.0.1:9", "--vocab-size", "320",
                   "--workload", "random", "--random-range-ratio", "2"])  # fmt: skip
    assert rc == 2
    assert "range ratio" in capsys.readouterr().err
    assert math.isinf(LoadOptions().request_rate)
