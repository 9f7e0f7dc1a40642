"""The storage tier under tensor parallelism (real rank processes over gloo): each rank's pages
are keyed by the heads it holds (or "latent", the same on every rank), one rank writes each
replicated page, the ranks agree on what every prefetch brought before any tree changes, and
greedy outputs equal TP 1 without any cache, with the file backend and a real Mooncake Store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually, make_checkpoint, random_prompts
from tests.test_storage import PAGE
from tests.test_storage import storage_llm as single_rank_storage_llm
from tierserve import LLM, SamplingParams
from tierserve.sizing.kv import KVSpec
from tierserve.storage import MooncakeMaster
from tierserve.storage.keys import Namespace, shard_of
from tierserve.storage.mooncake import MooncakeBackend
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


def every_rank_stored(llm: LLM, extra: dict, batch: list[list[int]]) -> bool:
    """Whether the store holds every rank's pages of `batch`'s prompts, asked through another
    client of it (each rank writes from its own process, in the background)."""
    ns = llm.engine.storage.namespace
    shards = [Namespace(ns.model, ns.spec, shard_of(ns.spec, r)) for r in range(2)]
    keys = [k for s in shards for p in batch for k in s.chain(None, p[:-1])]
    client = MooncakeBackend(extra)
    try:
        return eventually(lambda: all(client.exists(keys)), 30)
    finally:
        client.close()


def test_tp2_with_mooncake_survives_its_master_dying(models, master):
    """Objects live in the segments of the clients that stored them: one TP 2 server writes and
    reads back its own, then loses the master mid-run."""
    path = models["llama"]
    want = {s: reference(path, s) for s in (3, 4)}
    # The default call timeout (2 s) for a live master; a short cooldown, so the breaker
    # lets calls test the dead one again soon.
    quick = master.extra(breaker_cooldown_s=0.5)
    with storage_llm(path, "mooncake", quick, tp=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts(3), GREEDY)] == want[3]
        assert every_rank_stored(llm, master.extra(), prompts(3))
        llm.engine.flush_cache()  # device and host: the next pass reads the store
        outs = llm.generate(prompts(3), GREEDY)
        assert [o.token_ids for o in outs] == want[3]
        stats = llm.engine.storage.stats
        assert stats.hit_pages > 0 and all(o.cached_tokens > 0 for o in outs)
        master.stop()  # mid-run: hits are lost, never outputs or liveness
        llm.engine.flush_cache()
        assert [o.token_ids for o in llm.generate(prompts(4), GREEDY)] == want[4]
        assert [o.token_ids for o in llm.generate(prompts(3), GREEDY)] == want[3]
        assert stats.timeouts + stats.errors + stats.breaker_skips > 0
        master.start()  # back on its ports before the clients close (they unmount through it)


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
