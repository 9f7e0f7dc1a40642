"""The storage tier (L3): outputs equal a run without any cache, a restarted server finds its
pages in a file directory, whose cap holds for every process writing to it and which comes back
when removed, two servers share pages through a real Mooncake Store, damaged objects are caught
and recomputed (a damaged chain rewritten whole), and a store that is slow, full or down costs
hits, never correctness or liveness; the auto prefetch policy waits when reading beats
recomputing."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import Server, http, random_prompts, serve_cmd
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.args import default_model
from tierserve.sizing.kv import KVSpec
from tierserve.storage.client import GuardedStore, StorageStats, StorageUnavailable
from tierserve.storage.config import StorageConfig
from tierserve.storage.file import FileBackend
from tierserve.storage.keys import Namespace
from tierserve.storage.mooncake import MooncakeMaster
from tierserve.storage.prefetch_policy import MeasuredRate, PrefetchRates
from tierserve.storage.registry import register
from tierserve.utils import free_port

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PAGE = 16


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    return random_prompts(n, [420, 300, 520], seed=seed)  # above the 256-token threshold


def storage_llm(model: Path, backend: str, extra: dict, **kw) -> LLM:
    args = dict(
        page_size=PAGE,
        max_total_tokens=4096,
        enable_hierarchical_cache=True,
        hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_storage_prefetch_policy="wait_complete",
    )
    return LLM(str(model), **{**args, **kw})


@pytest.fixture(scope="module")
def reference(llama_dir) -> dict[int, list[list[int]]]:
    """Greedy outputs without any cache, by prompt seed."""
    llm = LLM(str(llama_dir), page_size=PAGE, max_total_tokens=4096, disable_radix_cache=True)
    return {s: [o.token_ids for o in llm.generate(prompts(s), GREEDY)] for s in (1, 2, 3, 4, 5)}


def run(llm: LLM, seed: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(seed), GREEDY)]


# --- file -----------------------------------------------------------------------------------


def test_a_restarted_engine_finds_its_pages_in_the_directory(llama_dir, tmp_path, reference):
    extra = {"path": str(tmp_path / "kv"), "batch_pages": 4}  # many batches per prompt
    first = storage_llm(llama_dir, "file", extra)
    assert run(first, 1) == reference[1]
    assert first.engine.storage.flush_writes()
    assert first.engine.storage.stats.written_pages > 0
    first.engine.close()

    again = storage_llm(llama_dir, "file", extra)  # a new process would see the same files
    outs = again.generate(prompts(1), GREEDY)
    assert [o.token_ids for o in outs] == reference[1]
    for o in outs:
        assert o.cached_tokens >= o.prompt_tokens - PAGE
    stats = again.engine.storage.stats
    assert stats.hit_pages > 0 and stats.corrupt_objects == 0
    assert again.engine.kv.host.stats.host_hit_tokens > 0  # loaded back from the host tier
    # One prefetch per prompt, each page read once, however many batches it took.
    assert stats.prefetches == 3 and stats.dropped_prefetch_pages == 0
    hits = stats.hit_pages
    again.engine.flush_cache()  # the same prompts again: fetched again, none left stale
    assert run(again, 1) == reference[1]
    assert stats.hit_pages == 2 * hits


def test_a_chain_of_damaged_pages_is_rewritten_whole(llama_dir, tmp_path, reference):
    """Every stored page damaged (a flipped byte, or another key's intact object): the first
    pass stops at each prompt's first page and recomputes, and rewrites every page after it
    too, though `exists` sees them; the second pass hits each whole prompt."""
    store = tmp_path / "kv"
    writer = storage_llm(llama_dir, "file", {"path": str(store)})
    run(writer, 2)
    assert writer.engine.storage.flush_writes()
    files = sorted(p for p in store.glob("??/*") if p.is_file())
    originals = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        if i % 2:
            data = bytearray(originals[i])
            data[-100] ^= 0xFF  # a flipped byte in the payload
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(originals[i - 1])  # another key's intact object

    reader = storage_llm(llama_dir, "file", {"path": str(store)})
    assert run(reader, 2) == reference[2]
    stats = reader.engine.storage.stats
    assert stats.corrupt_objects == 3 and stats.hit_pages == 0  # each prompt's first page
    assert reader.engine.storage.flush_writes()
    prompt_pages = sum((len(p) - 1) // PAGE for p in prompts(2))
    assert stats.written_pages >= prompt_pages  # the damaged and every page after them
    reader.engine.flush_cache()  # device and host: the pages are in the directory alone
    outs = reader.generate(prompts(2), GREEDY)
    assert [o.token_ids for o in outs] == reference[2]
    assert all(o.cached_tokens >= o.prompt_tokens - PAGE for o in outs)
    assert stats.corrupt_objects == 3


def test_the_directory_cap_evicts_least_recently_used(tmp_path):
    backend = FileBackend({"path": str(tmp_path), "max_bytes": 10_000})
    backend.put({f"{i:02d}key": b"x" * 1000 for i in range(8)})
    time.sleep(0.01)
    assert backend.get(["00key"]) == [b"x" * 1000]  # read: now the most recently used
    backend.put({f"{i:02d}key": b"y" * 1000 for i in range(8, 12)})  # 12,000 B > cap
    present = backend.exists([f"{i:02d}key" for i in range(12)])
    assert present[0] and all(present[8:])  # the recent read and the newest stay
    assert not all(present[1:8]) and backend.used <= 10_000
    assert backend.evicted > 0


def test_a_record_no_process_wrote_is_counted_again(tmp_path):
    """A negative count in .usage was trusted: eviction never ran and the cap meant nothing."""
    FileBackend({"path": str(tmp_path), "max_bytes": 10_000}).put({"00key": b"x" * 1000})
    (tmp_path / ".usage").write_text('{"used": -1000000000, "cap": 10000}')
    backend = FileBackend({"path": str(tmp_path)})
    assert backend.used >= 1000  # the directory counted again
    backend.put({f"{i:02d}key": b"y" * 1000 for i in range(1, 14)})  # 14,000 B > cap
    assert backend.used <= 10_000 and backend.evicted > 0


def test_pages_a_full_directory_has_no_room_for_count_as_dropped_not_written(
    llama_dir, tmp_path, reference
):
    """A batch larger than what eviction leaves is written as far as it fits; the rest were
    counted as written, and worth asking for again."""
    extra = {"path": str(tmp_path / "open"), "batch_pages": 64}  # a prompt's pages at once
    uncapped = storage_llm(llama_dir, "file", extra)
    assert run(uncapped, 1) == reference[1]
    assert uncapped.engine.storage.flush_writes()
    offered = uncapped.engine.storage.stats
    uncapped.engine.close()
    one = offered.written_bytes // offered.written_pages  # an object's bytes, header included
    cap = 8 * one + 64  # 8 of a prompt's ~26 pages, and the 64-byte record
    capped = storage_llm(llama_dir, "file", {**extra, "path": str(tmp_path / "full"),
                                             "max_bytes": cap})  # fmt: skip
    assert run(capped, 1) == reference[1]
    assert capped.engine.storage.flush_writes()
    stats, backend = capped.engine.storage.stats, capped.engine.storage.backend
    objects = [p for p in (tmp_path / "full").rglob("*") if p.is_file() and p.name != ".usage"]
    assert stats.dropped_writes > 0 and backend.evicted > 0
    assert len(objects) == stats.written_pages - backend.evicted  # placed, less evicted
    assert directory_bytes(tmp_path / "full") <= cap
    capped.engine.close()


WRITER = """
import sys
from tierserve.storage.file import FileBackend
backend = FileBackend({"path": sys.argv[1], "max_bytes": int(sys.argv[2])})
print("open", flush=True)
sys.stdin.readline()  # every process has opened the directory before any writes
for batch in range(3):  # 12,000 B: under the cap, each process alone
    backend.put({f"{sys.argv[3]}{batch:02d}{i}": bytes(1000) for i in range(4)})
"""


def directory_bytes(root: Path) -> int:
    """What the directory holds, read from it: every file, objects and record."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_the_directory_cap_holds_for_every_process_writing_to_it(tmp_path):
    """Four processes opened the directory before any wrote (each counted its own writes, so
    none evicted and the directory grew to 2.4x the cap): now its record counts them all."""
    cap = 20_000
    cmd = [sys.executable, "-c", WRITER, str(tmp_path), str(cap)]
    procs = [
        subprocess.Popen([*cmd, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for name in ("aa", "bb", "cc", "dd")
    ]
    for proc in procs:
        assert proc.stdout.readline() == "open\n"
    for proc in procs:
        proc.stdin.close()  # go: 48,000 B at once
    assert [proc.wait(timeout=60) for proc in procs] == [0] * 4
    assert cap * 0.5 < directory_bytes(tmp_path) <= cap
    # A process given no cap takes the directory's (the last one given).
    assert FileBackend({"path": str(tmp_path)}).max_bytes == cap


def test_processes_agree_on_the_default_cap(tmp_path):
    first = FileBackend({"path": str(tmp_path)})
    first.put({"aakey": bytes(10_000)})  # less free space now: the cap must not follow it
    second = FileBackend({"path": str(tmp_path)})
    assert second.max_bytes == first.max_bytes > 0
    free, used = shutil.disk_usage(tmp_path).free, directory_bytes(tmp_path)
    assert first.max_bytes <= (free + used) // 2 + 10_000


def test_a_removed_directory_is_made_again_and_hits_return(llama_dir, tmp_path, reference, caplog):
    store = tmp_path / "kv"
    llm = storage_llm(llama_dir, "file", {"path": str(store)})
    assert run(llm, 3) == reference[3] and llm.engine.storage.flush_writes()
    shutil.rmtree(store)  # mid-run: the server's next call makes it again
    llm.engine.flush_cache()
    with caplog.at_level(logging.WARNING, logger="tierserve"):
        assert run(llm, 3) == reference[3]  # recomputed, and written again
    assert any("vanished while serving: made again" in r.message for r in caplog.records)
    assert llm.engine.storage.flush_writes() and list(store.glob("??/*"))
    llm.engine.flush_cache()
    outs = llm.generate(prompts(3), GREEDY)
    assert [o.token_ids for o in outs] == reference[3]
    assert all(o.cached_tokens >= o.prompt_tokens - PAGE for o in outs)
    assert llm.engine.storage.store.state == "closed"


@pytest.mark.parametrize("path", [5, "FILE", "/proc/tierserve-nowhere"])
def test_a_storage_path_that_cannot_be_used_is_refused_at_start(llama_dir, tmp_path, path):
    """A number, a file, a place no directory can be made: a TypeError, NotADirectoryError or
    FileNotFoundError ended the start as a crash (exit 1, a traceback)."""
    (tmp_path / "file").write_text("not a directory")
    path = str(tmp_path / "file") if path == "FILE" else path
    with pytest.raises(TierserveError) as err:
        storage_llm(llama_dir, "file", {"path": path})
    assert err.value.field == "hicache_storage_backend_extra_config"
    assert "path" in err.value.message


def test_a_path_that_cannot_be_a_directory_opens_the_breaker_with_a_log_line(tmp_path, caplog):
    backend = FileBackend({"path": str(tmp_path / "kv")})
    stats = StorageStats()
    store = GuardedStore(backend, stats, failures_to_open=2, cooldown_s=60)
    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="tierserve"):
        for call in ((backend.exists, ["aakey"]), (backend.put, {"aakey": b"x"})):
            with pytest.raises(StorageUnavailable):
                store.call(*call)
    assert store.state == "open" and stats.breaker_opens == 1 and stats.errors == 2
    (line,) = [r.message for r in caplog.records if "circuit breaker open" in r.message]
    assert "NotADirectoryError" in line and "is not a directory" in line


def test_flush_cache_empties_device_and_host_and_keeps_storage(llama_dir, tmp_path):
    llm = storage_llm(llama_dir, "file", {"path": str(tmp_path)})
    run(llm, 3)
    assert llm.engine.storage.flush_writes()
    report = llm.engine.flush_cache()
    assert report["device_pages"] > 0 and report["host_pages"] > 0
    assert "kept" in report["storage"]
    assert list(tmp_path.glob("??/*"))


def test_a_server_restarted_on_the_same_directory_reports_cached_tokens(tmp_path):
    """The issue's case, with the default policy (auto): the first request after a restart finds
    an idle engine, and still waits for its stored prefix, because reading 600 tokens' pages
    beats recomputing them (the bundled demo model, as `make serve` runs it)."""
    model = Path(default_model() or "")
    flags = (
        "--max-total-tokens", "4096", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp_path)}),
    )  # fmt: skip
    prompt = random_prompts(1, [600], seed=4)[0]
    # One token: the request ends in its prefill step, so its copies to the host are still
    # queued at SIGTERM; closing lands them and hands them to storage.
    body = dict(model=model.name, prompt=prompt, max_tokens=1, temperature=0)
    first = Server(model, *flags)
    try:
        c = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
        expected = c.completions.create(**body)
    finally:
        first.stop()  # SIGTERM: queued writes finish before the process exits
    second = Server(model, *flags)
    try:
        c = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
        out = c.completions.create(**body)
        assert out.choices[0].text == expected.choices[0].text
        assert out.usage.prompt_tokens_details.cached_tokens >= len(prompt) - PAGE
        metrics = second.metrics()
        assert metrics["tierserve_storage_hit_pages_total"] > 0
        assert metrics["tierserve_storage_breaker{state=closed}"] == 1
    finally:
        second.stop()


# --- the auto prefetch policy ---------------------------------------------------------------


def stored(llama_dir: Path, path: Path, seed: int) -> None:
    """Prompts `seed` computed once and written to the file store at `path`."""
    writer = storage_llm(llama_dir, "file", {"path": str(path)})
    run(writer, seed)
    assert writer.engine.storage.flush_writes()
    writer.engine.close()


@pytest.mark.parametrize(
    ("rates", "waits"),
    [
        ({"prefetch_read_bytes_per_s": 1e12, "prefetch_recompute_tokens_per_s": 1}, True),
        ({"prefetch_read_bytes_per_s": 1, "prefetch_recompute_tokens_per_s": 1e12}, False),
    ],
    ids=["reading-wins", "recomputing-wins"],
)
def test_auto_waits_for_a_lone_request_when_reading_beats_recomputing(
    llama_dir, tmp_path, reference, rates, waits
):
    stored(llama_dir, tmp_path, 1)
    extra = {"path": str(tmp_path), **rates}
    reader = storage_llm(llama_dir, "file", extra, hicache_storage_prefetch_policy="auto")
    (out,) = reader.generate(prompts(1)[:1], GREEDY)  # alone: the engine is idle
    assert out.token_ids == reference[1][0]
    if waits:
        assert out.cached_tokens >= out.prompt_tokens - PAGE
    else:
        assert out.cached_tokens == 0  # admitted at once, as best_effort would


OPEN = threading.Event()  # GatedFileBackend's lookups wait for it


@register("gated-file")
class GatedFileBackend(FileBackend):
    """The file backend whose lookups answer only once the test opens `OPEN`."""

    def exists(self, keys):
        OPEN.wait(60)
        return super().exists(keys)


def test_auto_never_waits_longer_than_recomputing_would_take(llama_dir, tmp_path, reference):
    """A store that cannot answer before the request has finished, a recompute estimate of
    0.1 s: the request waits out the estimate (not less) and goes ahead without the pages."""
    stored(llama_dir, tmp_path, 1)
    prompt = prompts(1)[0]
    extra = {"path": str(tmp_path), "timeout_s": 60, "prefetch_read_bytes_per_s": 1e12}
    extra["prefetch_recompute_tokens_per_s"] = len(prompt) / 0.1
    reader = storage_llm(llama_dir, "gated-file", extra, hicache_storage_prefetch_policy="auto")
    OPEN.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            # The bound only caps a hang: the store stays shut until the request is done.
            (out,) = pool.submit(reader.generate, [prompt], GREEDY).result(timeout=60)
            waited = time.monotonic() - start
    finally:
        OPEN.set()
    assert waited >= 0.1  # it waited for the estimate's length
    assert out.token_ids == reference[1][0] and out.cached_tokens == 0


def test_auto_measures_both_rates_it_weighs(llama_dir, tmp_path, reference):
    stored(llama_dir, tmp_path, 1)
    reader = storage_llm(
        llama_dir, "file", {"path": str(tmp_path)}, hicache_storage_prefetch_policy="auto"
    )
    rates = reader.engine.storage.rates
    assert rates.read.measured is None and rates.recompute.measured is None
    assert rates.recompute.value == rates.recompute.prior > 0  # the FLOPs estimate stands in
    assert run(reader, 1) == reference[1]
    assert rates.read.measured > 0 and rates.recompute.measured > 0
    assert reader.engine.storage.stats.hit_pages > 0


def test_auto_weighs_reading_against_recomputing():
    rates = PrefetchRates(MeasuredRate(pinned=1e9), MeasuredRate(prior=1e4))
    assert rates.wait_limit(1000, 10**6) == pytest.approx(0.1)  # 1 ms to read, 0.1 s to compute
    assert rates.wait_limit(1000, 10**9) == 0.0  # 1 s to read: recompute instead
    unknown = PrefetchRates(MeasuredRate(), MeasuredRate(prior=1e4))
    assert unknown.wait_limit(1000, 10**12) == pytest.approx(0.1)  # no read measured: try it
    rates.recompute.observe(1000, 0.01)  # measured 1e5 tok/s replaces the prior
    assert rates.recompute_seconds(1000) == pytest.approx(0.01)
    rates.recompute.observe(1000, 0.1)  # smoothed, not replaced
    assert 0.01 < rates.recompute_seconds(1000) < 0.1


# --- a slow, full or failing store ----------------------------------------------------------


@register("slow-file")
class SlowFileBackend(FileBackend):
    """The file backend behind a slow link: every call takes `delay_s`."""

    config_keys = FileBackend.config_keys | {"delay_s"}

    def __init__(self, extra) -> None:
        super().__init__(extra)
        self.delay_s = float(extra.get("delay_s", 0.5))

    def exists(self, keys):
        time.sleep(self.delay_s)
        return super().exists(keys)

    def put(self, items):
        time.sleep(self.delay_s)
        return super().put(items)


@register("gappy-file")
class GappyFileBackend(FileBackend):
    """Objects that vanish between `exists` and `get` (another server evicted them)."""

    def get(self, keys):
        blobs = super().get(keys)
        return [None if int(k, 16) % 3 == 0 else b for k, b in zip(keys, blobs, strict=True)]


def test_objects_gone_between_exists_and_get_are_misses(llama_dir, tmp_path, reference):
    writer = storage_llm(llama_dir, "file", {"path": str(tmp_path)})
    run(writer, 4)
    assert writer.engine.storage.flush_writes()
    reader = storage_llm(llama_dir, "gappy-file", {"path": str(tmp_path)})
    assert run(reader, 4) == reference[4]
    stats = reader.engine.storage.stats
    assert stats.miss_pages > 0 and stats.corrupt_objects == 0


def test_a_slow_store_costs_hits_never_correctness(llama_dir, tmp_path, reference):
    extra = {"path": str(tmp_path), "delay_s": 0.4, "timeout_s": 0.1, "breaker_cooldown_s": 0.2}
    llm = storage_llm(llama_dir, "slow-file", extra)
    start = time.monotonic()
    assert run(llm, 5) == reference[5]
    assert time.monotonic() - start < 30
    stats = llm.engine.storage.stats
    assert stats.timeouts > 0 and stats.hit_pages == 0
    assert stats.breaker_opens > 0


def test_a_full_write_queue_drops_writes_instead_of_waiting(llama_dir, tmp_path, reference):
    extra = {"path": str(tmp_path), "delay_s": 0.3, "write_queue_bytes": 100_000}  # ~12 pages
    llm = storage_llm(llama_dir, "slow-file", extra, hicache_storage_prefetch_policy="best_effort")
    assert run(llm, 3) == reference[3]
    assert llm.engine.storage.stats.dropped_writes > 0


RELEASE = threading.Event()  # StuckCloseFileBackend's close returns once the test sets it


@register("stuck-close-file")
class StuckCloseFileBackend(FileBackend):
    """The file backend whose client teardown does not return (a store gone mid-close)."""

    tears_down = True

    def close(self):
        RELEASE.wait(60)


def test_a_store_close_that_does_not_return_is_abandoned_after_its_timeout(
    llama_dir, tmp_path, caplog
):
    extra = {"path": str(tmp_path), "close_timeout_s": 0.1}
    llm = storage_llm(llama_dir, "stuck-close-file", extra)
    RELEASE.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tierserve"):
            llm.close()  # returns: the teardown is left on its daemon thread
        assert llm.engine.storage.client_left_open
    finally:
        RELEASE.set()
    (line,) = [r.message for r in caplog.records if "client teardown" in r.message]
    assert "abandoned after close_timeout_s = 0.1 s" in line


CLOSED: list[str] = []  # ClosedCountFileBackend's closes, by the path it stores to


@register("closed-count-file")
class ClosedCountFileBackend(FileBackend):
    """The file backend, counting its client's closes."""

    def __init__(self, extra):
        super().__init__(extra)
        self.path = str(extra["path"])

    def close(self):
        CLOSED.append(self.path)
        super().close()


def test_a_start_that_fails_after_the_store_opened_closes_its_client(llama_dir, tmp_path):
    """The store is opened before the weights load, so that an unreachable one refuses the
    start at no cost; weights that do not match the model then fail the start, and the store's
    client is closed on the way out, not left to the process's exit (an engine core or rank
    ends without Python's teardown, whose exit handlers would have closed it)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(model / "model.safetensors"))
    store = tmp_path / "store"
    with pytest.raises(TierserveError, match="does not match"):
        storage_llm(model, "closed-count-file", {"path": str(store)})
    assert CLOSED.count(str(store)) == 1


EXTRA = "hicache_storage_backend_extra_config"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"hicache_storage_backend": "tape"}, "hicache_storage_backend"),
        ({EXTRA: "{not json"}, EXTRA),
        ({EXTRA: '{"timeout_s": -1}'}, EXTRA),
        ({EXTRA: '{"max_bytes": "12"}'}, EXTRA),  # no unit: bytes or GB?
        ({EXTRA: '{"batch_pages": 0}'}, EXTRA),  # would fetch nothing, for ever
        ({EXTRA: '{"write_queue_bytes": 1.5}'}, EXTRA),
    ],
)
def test_bad_storage_flags_are_refused_naming_the_flag(llama_dir, tmp_path, kw, field):
    base = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": json.dumps({"path": str(tmp_path)}),
    }
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), enable_hierarchical_cache=True, max_total_tokens=1024, **{**base, **kw})
    assert err.value.field == field


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        # A TypeError traceback (the config's own fields taken from the JSON twice).
        ({"backend": 1}, "'backend' is not a storage config key: give --hicache-storage-backend"),
        ({"prefetch_policy": "best"}, "give --hicache-storage-prefetch-policy"),
        # Served from the default directory, silently.
        ({"pathh": "PATH"}, "unknown key 'pathh' in the file storage config"),
        ({"path": ""}, "must be a directory's path"),
        # Accepted, then every call overflowed the clock and the breaker stayed open.
        ({"path": "PATH", "timeout_s": 1e10}, "timeout_s in the storage config must be < 1e+06"),
        # Kept nothing while every page counted as written.
        ({"path": "PATH", "max_bytes": 0}, "less than one page"),
    ],
)  # fmt: skip
def test_storage_config_keys_that_cannot_serve_are_refused_by_name(
    llama_dir, tmp_path, extra, words
):
    text = json.dumps(extra).replace("PATH", str(tmp_path / "kv"))
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), enable_hierarchical_cache=True, max_total_tokens=1024,
            hicache_storage_backend="file", hicache_storage_backend_extra_config=text)  # fmt: skip
    assert err.value.field == EXTRA and words in err.value.message
    assert not (tmp_path / "kv").exists()


def test_buffers_past_ram_are_refused_without_a_size_that_cannot_help(llama_dir, tmp_path):
    """The refusal said "use --hicache-size 0.0", which is refused too."""
    extra = json.dumps({"path": str(tmp_path / "kv"), "batch_pages": 10**14})
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), enable_hierarchical_cache=True, max_total_tokens=1024,
            hicache_storage_backend="file", hicache_storage_backend_extra_config=extra)  # fmt: skip
    assert "leaves nothing for it" in err.value.message and "batch_pages" in err.value.message
    assert "use --hicache-size" not in err.value.message


def test_mooncake_keys_are_checked_before_its_client_loads():
    for extra, words in (({"bogus": 1}, "unknown key 'bogus' in the mooncake"),
                         ({"protocol": 5}, "protocol in the storage config must be a string"),
                         ({"master_server_address": "nohost"}, "must be host:port")):  # fmt: skip
        with pytest.raises(TierserveError, match=words):
            StorageConfig.parse("mooncake", json.dumps(extra))
    # An HA list is the client's to read: nothing is probed or refused here.
    assert StorageConfig.parse("mooncake", '{"master_server_address": "etcd://10.0.0.1:2379"}')


def test_storage_without_the_host_tier_is_refused(llama_dir):
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), hicache_storage_backend="file")
    assert "--enable-hierarchical-cache" in err.value.message


# --- keys -----------------------------------------------------------------------------------


def test_keys_name_model_format_and_shard_and_are_stable_across_processes():
    spec = KVSpec("kv", 2, 2, 32, "float32", 16, 2, 1)
    base = Namespace("model-a", spec)
    others = [
        Namespace("model-b", spec),
        Namespace("model-a", KVSpec("kv", 2, 2, 32, "fp8_e4m3", 16, 2, 1)),
        Namespace("model-a", KVSpec("kv", 2, 2, 32, "float32", 32, 2, 1)),
        Namespace("model-a", spec, shard="tp1/2"),
    ]
    tokens = list(range(64))
    keys = base.chain(None, tokens)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert all(set(o.chain(None, tokens)).isdisjoint(keys) for o in others)
    # Chained: a page's key covers every token before it.
    assert base.chain(keys[1], tokens[32:]) == keys[2:]
    assert base.chain(None, [9, *tokens[1:]])[3] != keys[3]
    code = (
        "from tierserve.sizing.kv import KVSpec; from tierserve.storage.keys import Namespace;"
        "print(Namespace('model-a', KVSpec('kv', 2, 2, 32, 'float32', 16, 2, 1))"
        ".chain(None, list(range(64)))[-1])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert other.stdout.strip() == keys[-1]


def test_the_model_fingerprint_follows_config_headers_and_weights(checkpoints, tmp_path):
    from tests.conftest import make_checkpoint
    from tierserve.models.loader import model_fingerprint

    fingerprints = {model_fingerprint(checkpoints[f]) for f in ("llama", "llama3", "qwen3")}
    assert len(fingerprints) == 3
    assert model_fingerprint(checkpoints["llama"]) == model_fingerprint(checkpoints["llama"])
    # Same config, same shapes, other weights (a fine-tune): another namespace.
    retrained = make_checkpoint(tmp_path / "llama", "llama", seed=1)
    assert model_fingerprint(retrained) != model_fingerprint(checkpoints["llama"])
    assert model_fingerprint(retrained, "salt") != model_fingerprint(retrained)


# --- Mooncake Store -------------------------------------------------------------------------


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster()
    yield m
    m.stop()


def test_servers_share_pages_through_mooncake_and_a_killed_ones_cost_only_hits(llama_dir, master):
    """B reads the pages A stored. Then A is SIGKILLed while its segment holds them: the master
    may still list them, but B's reads fail within the store's timeout, and it recomputes."""
    flags = (
        "--max-total-tokens", "4096", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(master.extra()),
        "--hicache-storage-prefetch-policy", "wait_complete",
    )  # fmt: skip
    a, b = Server(llama_dir, *flags), None
    try:
        prompt = prompts(6, 1)[0]
        body = dict(model=llama_dir.name, prompt=prompt, max_tokens=4, temperature=0)
        ca = openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0)
        first = ca.completions.create(**body)
        pages = (len(prompt) - 1) // PAGE
        a.wait_for(lambda m: m["tierserve_storage_written_pages_total"] >= pages)
        # Started after A's writes, B's segment holds none of them: all are in A's.
        b = Server(llama_dir, *flags)
        cb = openai.OpenAI(base_url=f"{b.url}/v1", api_key="x", max_retries=0, timeout=60)
        second = cb.completions.create(**body)
        assert second.choices[0].text == first.choices[0].text
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        hits = b.metrics()["tierserve_storage_hit_pages_total"]
        assert hits > 0

        a.proc.kill()  # its engine core dies with it (a parent-death signal)
        a.proc.wait(timeout=30)
        http.post(f"{b.url}/flush_cache", timeout=30).raise_for_status()  # the store alone
        third = cb.completions.create(**body)
        assert third.choices[0].text == first.choices[0].text
        metrics = b.metrics()
        assert metrics["tierserve_storage_hit_pages_total"] == hits
        failed = ("errors", "timeouts", "miss_pages", "breaker_skips")
        assert sum(metrics[f"tierserve_storage_{f}_total"] for f in failed) > 0, metrics
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_mooncake_outage_costs_hits_and_the_store_comes_back(llama_dir, master, reference):
    extra = master.extra(timeout_s=0.5, breaker_cooldown_s=0.3, breaker_failures=2)
    llm = storage_llm(llama_dir, "mooncake", extra)
    assert run(llm, 1) == reference[1]
    storage = llm.engine.storage
    assert storage.flush_writes() and storage.stats.written_pages > 0

    master.stop()  # mid-run: everything still completes, correctly, by recomputing
    llm.engine.flush_cache()
    assert run(llm, 2) == reference[2]
    assert run(llm, 1) == reference[1]
    down = storage.stats
    assert down.timeouts + down.errors > 0 and down.breaker_opens > 0

    master.start()  # same ports: the client reconnects; objects stored before may be gone
    time.sleep(0.5)  # past the breaker's cooldown
    written = storage.stats.written_pages
    deadline = time.monotonic() + 30
    while storage.stats.written_pages == written:  # new writes land once the master is back
        llm.engine.flush_cache()
        assert run(llm, 4) == reference[4]
        storage.flush_writes()
        assert time.monotonic() < deadline, storage.stats
    # Device and host emptied: only the store holds the pages. The client's reconnection can
    # still fail a read or two (its RPCs time out under a loaded machine) and open the
    # breaker for a moment, so the store counts as back once a run hits it.
    deadline = time.monotonic() + 30
    while True:
        hits = storage.stats.hit_pages
        llm.engine.flush_cache()
        assert run(llm, 4) == reference[4]
        if storage.stats.hit_pages > hits:
            break
        assert time.monotonic() < deadline, storage.stats
        time.sleep(0.3)
    llm.engine.close()


def test_objects_overwritten_in_mooncake_are_caught_and_recomputed(llama_dir, master, reference):
    from tierserve.storage.mooncake import MooncakeBackend

    writer = storage_llm(llama_dir, "mooncake", master.extra())
    assert run(writer, 3) == reference[3]
    assert writer.engine.storage.flush_writes()
    namespace = writer.engine.storage.namespace
    keys = namespace.chain(None, prompts(3)[0])
    intruder = MooncakeBackend(master.extra())  # another client of the same store
    [other] = intruder.get([keys[0]])
    assert other is not None
    intruder.put({keys[3]: other})  # page 3 now holds page 0's (intact) object

    reader = storage_llm(llama_dir, "mooncake", master.extra())
    assert run(reader, 3) == reference[3]
    stats = reader.engine.storage.stats
    assert stats.corrupt_objects == 1 and stats.hit_pages >= 3
    for llm in (reader, writer):
        llm.engine.close()
    intruder.close()


def test_the_start_up_plan_counts_mooncakes_ram_and_refuses_what_does_not_fit(llama_dir, master):
    extra = master.extra(global_segment_size="10TB", local_buffer_size="1GiB")
    cmd = serve_cmd(llama_dir, "--enable-hierarchical-cache", "--hicache-storage-backend",
                    "mooncake", "--hicache-storage-backend-extra-config", json.dumps(extra),
                    "--dry-run")  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "overhead" in done.stderr and "Traceback" not in done.stderr
    extra["global_segment_size"] = "1GB"
    cmd[-2] = json.dumps(extra)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "storage client RAM" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("backend", "extra", "words"),
    [
        ("mooncake", {"master_server_address": "127.0.0.1:PORT"},
         "mooncake_master does not answer at 127.0.0.1:"),
        ("mooncake", {"master_server_address": "localhost"}, "must be host:port"),
        ("file", {"path": "FILE/kv"}, "is not a directory"),
    ],
)  # fmt: skip
def test_the_dry_run_checks_the_store_it_would_open(llama_dir, tmp_path, backend, extra, words):
    """The dry run said "would start" for a master nobody runs (the start then retried for
    ~50 s) and for a storage path under a file; now both are one line, exit 2, in seconds."""
    (tmp_path / "file").write_text("not a directory")
    text = (
        json.dumps(extra).replace("PORT", str(free_port())).replace("FILE", str(tmp_path / "file"))
    )
    cmd = serve_cmd(llama_dir, "--enable-hierarchical-cache", "--hicache-storage-backend", backend,
                    "--hicache-storage-backend-extra-config", text, "--dry-run")  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "would start" not in done.stdout


def test_a_server_refuses_a_master_nobody_runs_before_the_clients_retries():
    """MooncakeBackend's open asks the same question first: its client's setup retried ~50 s."""
    from tierserve.storage.mooncake import MooncakeBackend

    with pytest.raises(TierserveError, match="does not answer") as err:
        MooncakeBackend({"master_server_address": f"127.0.0.1:{free_port()}"})
    assert err.value.field == "hicache_storage_backend_extra_config"


def test_plan_counts_each_processs_storage_client_in_the_node_budget():
    base = ["plan", "--model", "kimi-k2.5", "--gpu", "h200", "--tp", "8", "--host-mem", "2TB",
            "--json"]  # fmt: skip
    extra = json.dumps({"global_segment_size": "16GB", "local_buffer_size": "1GB"})
    mooncake = ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config"]
    plans = []
    for flags in ([], [*mooncake, extra]):
        out = subprocess.run(
            [sys.executable, "-m", "tierserve.cli", *base, *flags], capture_output=True, text=True
        )
        plans.append(json.loads(out.stdout))
    grown = plans[1]["host_overhead_bytes"] - plans[0]["host_overhead_bytes"]
    assert grown == 8 * 17 * 10**9  # eight ranks, each with its own segment and buffer
