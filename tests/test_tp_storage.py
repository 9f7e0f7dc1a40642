"""The storage tier under tensor parallelism (real rank processes over gloo): each rank's pages
are keyed by the heads it holds (or "latent", the same on every rank), one rank writes each
replicated page, the ranks agree on what every prefetch brought before any tree changes, and
greedy outputs equal TP 1 without any cache, with the file backend and a real Mooncake Store.
A file directory's cap holds for all the processes writing to it, and a TP server whose master
died stops without tearing its ranks' clients down against it."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Server, eventually, http, make_checkpoint, random_prompts
from tests.test_storage import PAGE, directory_bytes
from tests.test_storage import storage_llm as single_rank_storage_llm
from tierserve import LLM, SamplingParams
from tierserve.sizing.kv import KVSpec
from tierserve.storage import MooncakeMaster
from tierserve.storage.keys import shard_of
from tierserve.storage.prefetch import RankRoles

CPU = dict(device="cpu")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    return random_prompts(3, [420, 300, 520], seed=seed)  # above the 256-token threshold


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-storage")
    return {f: make_checkpoint(root / f, f) for f in ("llama", "deepseek-v3")}


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster()
    yield m
    m.stop()


def reference(path: Path, seed: int) -> list[list[int]]:
    with LLM(str(path), page_size=PAGE, max_total_tokens=4096, disable_radix_cache=True) as llm:
        return [o.token_ids for o in llm.generate(prompts(seed), GREEDY)]


def storage_llm(path: Path, backend: str, extra: dict, tp: int, **kw) -> LLM:
    """test_storage's engine (a request waits for its whole prefetch: hits are asserted) on
    `tp` ranks."""
    return single_rank_storage_llm(path, backend, extra, tp_size=tp, **CPU, **kw)


def stored_files(root: Path) -> int:
    return sum(1 for p in root.glob("??/*") if p.is_file())


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_tp2_reads_what_it_stored_with_the_file_backend(models, tmp_path, family):
    """llama's 2 KV heads: one per rank, two shards of pages. DeepSeek's latent: the same bytes
    on both ranks, shared host copy, one rank writes it and one reads it for the node."""
    path, want = models[family], reference(models[family], 1)
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    with storage_llm(path, "file", {"path": str(one)}, tp=1) as llm:  # the count of one copy
        llm.generate(prompts(1), GREEDY)
    with storage_llm(path, "file", {"path": str(two)}, tp=2) as writer:
        assert [o.token_ids for o in writer.generate(prompts(1), GREEDY)] == want
        written = writer.engine.storage
    # Closing flushed every rank's writes. A latent page is written once (by rank 0, which
    # wrote them all), a head slice's by its rank: so many objects, never more.
    copies = 1 if family == "deepseek-v3" else 2
    assert stored_files(two) == copies * stored_files(one) > 0
    if family == "deepseek-v3":
        assert written.stats.written_pages == stored_files(two)
    with storage_llm(path, "file", {"path": str(two)}, tp=2) as reader:
        outs = reader.generate(prompts(1), GREEDY)
        assert [o.token_ids for o in outs] == want
        assert all(o.cached_tokens >= o.prompt_tokens - PAGE for o in outs)
        stats = reader.engine.storage.stats
        assert stats.hit_pages > 0 and stats.corrupt_objects == 0


def test_an_mla_latent_stored_under_tp1_serves_tp2(models, tmp_path):
    """The latent is the same under every layout, so its pages are keyed alike."""
    path, want = models["deepseek-v3"], reference(models["deepseek-v3"], 2)
    with storage_llm(path, "file", {"path": str(tmp_path)}, tp=1) as llm:
        llm.generate(prompts(2), GREEDY)
    with storage_llm(path, "file", {"path": str(tmp_path)}, tp=2) as reader:
        assert [o.token_ids for o in reader.generate(prompts(2), GREEDY)] == want
        assert reader.engine.storage.stats.hit_pages > 0


def storage_flags(backend: str, extra: dict, *more: str) -> tuple[str, ...]:
    """A server as storage_llm's engine (on the CPU: gloo, and the same page bytes)."""
    return (
        "--max-total-tokens", "4096", "--page-size", str(PAGE), "--enable-hierarchical-cache",
        "--hicache-storage-backend", backend,
        "--hicache-storage-backend-extra-config", json.dumps(extra), "--device", "cpu", *more,
    )  # fmt: skip


def served(server: Server, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt's greedy output ids and cached prompt tokens, one request each."""
    out = []
    for prompt in batch:
        body = {"model": "llama", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        reply = http.post(f"{server.url}/v1/completions", json=body, timeout=120)
        reply.raise_for_status()
        answer = reply.json()
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        out.append((answer["choices"][0]["token_ids"], cached))
    return out


def flush_cache(server: Server) -> None:
    http.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()


def test_tp2_and_a_server_on_one_directory_keep_it_under_its_cap(models, tmp_path):
    """Three processes (a TP 2 engine's ranks and a server) write 1.6x the cap at once, each of
    them less than it: counted each by its own, the directory held them all."""
    path, cap = models["llama"], 800_000
    extra = {"path": str(tmp_path), "max_bytes": cap}
    server = Server(path, *storage_flags("file", extra))
    try:
        with storage_llm(path, "file", extra, tp=2) as llm, ThreadPoolExecutor(1) as pool:
            requests = pool.submit(served, server, prompts(2))
            llm.generate(prompts(1), GREEDY)
            requests.result(timeout=120)
            pages = sum((len(p) - 1) // PAGE for p in prompts(2))
            server.wait_for(lambda m: m["tierserve_storage_written_pages_total"] >= pages)
        written = llm.engine.storage.stats.written_bytes  # rank 0's: rank 1 wrote as many
        written += server.metrics()["tierserve_storage_written_bytes_total"]
    finally:
        server.stop()  # SIGTERM: its queued writes land
    assert written > cap
    assert directory_bytes(tmp_path) <= cap


def test_tp2_with_mooncake_survives_its_master_dying_and_stops_without_it(models, master):
    """Objects live in the segments of the clients that stored them: a TP 2 server writes and
    reads back its own, then loses the master mid-run, which costs hits, never outputs. Then
    SIGTERM: tearing a Mooncake client down against the dead master waits out its RPC timeouts
    (24 s at TP 2, one rank after another). Rank 0 now stops the other ranks before it closes
    its own storage, and each rank, finding the store silent, skips the teardown and exits
    without it (Mooncake's exit handler would do it): each says so once, and none runs."""
    path = models["llama"]
    want = {s: reference(path, s) for s in (3, 4)}
    # The default call timeout (2 s) for a live master; a short cooldown, so the breaker
    # lets calls test the dead one again soon.
    extra = master.extra(breaker_cooldown_s=0.5)
    policy = ("--hicache-storage-prefetch-policy", "wait_complete")
    server = Server(path, *storage_flags("mooncake", extra, *policy, "--tp-size", "2"))
    try:
        assert [ids for ids, _ in served(server, prompts(3))] == want[3]

        def every_prompt_hits() -> bool:  # once every rank's background writes have landed
            flush_cache(server)  # device and host: the next pass reads the store
            outs = served(server, prompts(3))
            assert [ids for ids, _ in outs] == want[3]
            return all(cached > 0 for _, cached in outs)

        assert eventually(every_prompt_hits, 60)
        master.stop()  # mid-run: hits are lost, never outputs or liveness
        flush_cache(server)
        assert [ids for ids, _ in served(server, prompts(4))] == want[4]
        assert [ids for ids, _ in served(server, prompts(3))] == want[3]
        failed = ("timeouts", "errors", "breaker_skips")
        assert sum(server.metrics()[f"tierserve_storage_{f}_total"] for f in failed) > 0
        server.stop()  # SIGTERM, the master dead
    finally:
        server.stop()
        master.start()  # for the tests after this one
    log = server.log_path.read_text()
    assert server.proc.returncode == -signal.SIGTERM, log  # its own exit: not killed
    skipped = [line for line in log.splitlines() if "client teardown skipped" in line]
    for shard in ("kv heads 0-0 of 2", "kv heads 1-1 of 2"):  # rank 0's and rank 1's
        assert sum(shard in line for line in skipped) == 1, log
    assert "Failed to unmount segment" not in log  # Mooncake's teardown, on no rank


def test_dp_attention_groups_read_their_own_pages(models, tmp_path):
    path, want = models["deepseek-v3"], reference(models["deepseek-v3"], 5)
    dp = dict(enable_dp_attention=True, dp_size=2)
    extra = {"path": str(tmp_path)}
    with storage_llm(path, "file", extra, tp=2, **dp) as writer:
        assert [o.token_ids for o in writer.generate(prompts(5), GREEDY)] == want
    with storage_llm(path, "file", extra, tp=2, **dp) as reader:
        outs = reader.generate(prompts(5), GREEDY)
        assert [o.token_ids for o in outs] == want
        assert sum(o.cached_tokens for o in outs) > 0  # whichever group each one went to


def test_shards_name_the_heads_a_rank_holds():
    split = KVSpec("kv", 2, 2, 32, "float32", 16, model_heads=4, tp=2)
    assert [shard_of(split, r) for r in (0, 1)] == ["kv heads 0-1 of 4", "kv heads 2-3 of 4"]
    replicated = KVSpec("kv", 2, 1, 32, "float32", 16, model_heads=2, tp=4)  # 2 ranks a head
    assert [shard_of(replicated, r) for r in range(4)] == [
        "kv heads 0-0 of 2", "kv heads 0-0 of 2", "kv heads 1-1 of 2", "kv heads 1-1 of 2",
    ]  # fmt: skip
    latent = KVSpec("latent", 2, 1, 576, "bfloat16", 16, tp=8)
    assert {shard_of(latent, r) for r in range(8)} == {"latent"}


def test_one_rank_writes_replicated_bytes_and_one_fills_a_shared_copy():
    def roles(spec: KVSpec, tp: int, sharing: int) -> list[tuple[bool, bool, bool]]:
        out = [RankRoles.of(spec, r, tp, tp, sharing, min) for r in range(tp)]
        return [(x.leads, x.fetches, x.writes) for x in out]

    latent = KVSpec("latent", 2, 1, 576, "bfloat16", 16, tp=4)
    assert roles(latent, 4, sharing=4) == [(True, True, True)] + [(False, False, False)] * 3
    # Without a shared host copy every rank reads its own, and still one writes.
    assert roles(latent, 4, sharing=1) == [(True, True, True)] + [(False, True, False)] * 3
    split = KVSpec("kv", 2, 1, 32, "float32", 16, model_heads=2, tp=2)
    assert roles(split, 2, sharing=1) == [(True, True, True), (False, True, True)]
