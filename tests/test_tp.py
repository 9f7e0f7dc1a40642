"""Tensor parallelism on CPU over gloo, with real rank processes: greedy outputs at TP 2 and 4
equal TP 1 (Llama, Qwen3 with kv_heads 2 at TP 4, DeepSeek-V3's MLA + MoE) with the radix cache
and the host tier on; each rank holds 1/tp of the sharded parameters; a node budget is checked
for all of a node's ranks once; a rank that dies takes the others with it."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import openai
import psutil
import pytest
import torch
import torch.distributed as dist

from tests.conftest import (
    Server,
    http,
    make_checkpoint,
    modules_after,
    random_prompts,
    running,
    serve_cmd,
)
from tests.test_hicache import mixed_workload, mixed_workload_reference
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.bench.client import parse_prometheus
from tierserve.distributed import node_start
from tierserve.distributed.placement import plan_placement
from tierserve.engine import engine as engine_module
from tierserve.engine import engine_metrics
from tierserve.layers.parallel import TPGroup, shards_by_name, tp_group
from tierserve.server.metrics import ServerMetrics
from tierserve.sizing.pools import DEFAULT_MARGIN
from tierserve.utils import free_port

# The ranks meet over gloo on CPU whatever the machine has (NCCL needs a GPU per rank), and the
# one-process references run there too, so outputs compare exactly.
CPU = dict(device="cpu")
HOST = dict(
    **CPU,
    max_total_tokens=480,
    chunked_prefill_size=128,
    enable_hierarchical_cache=True,
    hicache_ratio=8,
)


@pytest.fixture(scope="module")
def references(checkpoints, run_dir) -> dict[str, list[list[int]]]:
    """TP 1 outputs of the mixed workload (prefix reuse, eviction to the host, multi-turn)."""
    families = ("llama", "qwen3", "deepseek-v3")
    return {f: mixed_workload_reference(run_dir, checkpoints[f], **HOST) for f in families}


@pytest.mark.parametrize(
    ("family", "tp"), [("llama", 2), ("qwen3", 4), ("deepseek-v3", 2)]
)  # at TP 4 two KV heads are each replicated on two ranks; DeepSeek: the latent on both
def test_greedy_outputs_equal_tp1_with_radix_and_host_tier(checkpoints, references, family, tp):
    with LLM(str(checkpoints[family]), tp_size=tp, **HOST) as llm:
        assert mixed_workload(llm) == references[family]
        stats = llm.engine.kv.host.stats
        assert stats.host_hit_tokens > 0 and stats.load_backs > 0
        assert llm.engine.scheduler.stats.num_cached_tokens > 0
        spec = llm.engine.kv_plan.spec
        assert spec.tp == tp and spec.replicated == (family == "deepseek-v3" or tp > 2)
        # Replicated KV: one host copy per group of ranks holding it, written by one of them.
        assert (llm.engine.kv.host.share is not None) == spec.replicated


def test_each_rank_holds_its_share_of_the_sharded_parameters(checkpoints):
    path = str(checkpoints["deepseek-v3"])
    with LLM(path, **CPU) as whole:
        full = dict(whole.engine.runner.model.named_parameters())
    with LLM(path, tp_size=2, **CPU) as llm:
        model = llm.engine.runner.model
        sharded = shards_by_name(model)
        params = dict(model.named_parameters())
        assert sharded  # embeddings, heads, projections, experts
        for name, param in params.items():
            ratio = param.numel() / full[name].numel()
            assert ratio == (0.5 if name in sharded else 1.0), name
        held = sum(p.numel() for p in params.values())
        whole_bytes = sum(p.numel() for p in full.values())
        assert held < 0.6 * whole_bytes  # what stays whole is small (norms, router, kv_a)


def test_a_node_budget_that_fits_one_rank_but_not_two_is_refused(llama_dir):
    usable = psutil.virtual_memory().available - DEFAULT_MARGIN - 2 * 10**9  # minus overhead
    per_rank = int(usable * 0.7)  # one rank fits; two ranks ask 1.4× what the node has
    cmd = serve_cmd(llama_dir, "--device", "cpu")
    cmd += [
        "--tp-size",
        "2",
        "--enable-hierarchical-cache",
        "--hicache-size",
        f"{per_rank / 1e9:.3f}GB",
    ]
    env, tag = _tagged()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("host cache does not fit: 2 rank(s) ×") == 1
    # Refused before any pool: the start-up table (printed before allocating) never appears;
    # the other rank refused too.
    assert "KV cache plan" not in proc.stderr
    assert "rank 1 exited with status 2" in proc.stderr
    assert not _workers_left(tag)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_a_served_start_refused_before_the_ranks_meet_ends_the_rank_its_core_spawned(llama_dir):
    """The engine core spawns its rank before it loads torch (node_start.py): a start it
    refuses before the ranks meet (--device cuda without CUDA) still ends that rank."""
    env, tag = _tagged()
    cmd = serve_cmd(llama_dir, "--device", "cuda", "--tp-size", "2", "--port", str(free_port()))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "tierserve serve: error: device cuda requested but CUDA is not available"
    # It was started, then ended by its core, or refused the device itself first if its
    # imports won the race: either is said as such, never as a crash's "status -9".
    assert re.search(r"rank 1 (stopped by rank 0|exited with status 2)", proc.stderr)
    assert "status -9" not in proc.stderr
    assert not _workers_left(tag)


TEST_TAG = "TIERSERVE_TEST_TAG"  # read by nothing but these scans


def _workers_left(tag: str | None = None) -> list[psutil.Process]:
    """Rank processes that run; with `tag`, only those of the server started with it (another
    test's ranks, on the other worker of the suite, are not this test's leak)."""
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "tierserve.engine.worker" in " ".join(p.info["cmdline"] or [])
        and (tag is None or _tag_of(p) == tag)
    ]


def _tag_of(process: psutil.Process) -> str | None:
    try:
        return process.environ().get(TEST_TAG)
    except psutil.Error:
        return None


def _tagged() -> tuple[dict[str, str], str]:
    """An environment for a server whose processes (ranks too: they inherit it) carry a tag."""
    tag = uuid.uuid4().hex
    return {**os.environ, TEST_TAG: tag}, tag


def _ranks_of(pid: int) -> list[psutil.Process]:
    """Rank processes under `pid`, however deep (a server's engine core starts them)."""
    ranks = {w.pid for w in _workers_left()}
    return [p for p in psutil.Process(pid).children(recursive=True) if p.pid in ranks]


def test_a_rank_killed_during_start_up_ends_the_others(llama_dir):
    cmd = serve_cmd(llama_dir, "--device", "cpu")
    env, tag = _tagged()
    proc = subprocess.Popen([*cmd, "--tp-size", "2"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    worker = None
    while worker is None and time.monotonic() < deadline:
        children = _ranks_of(proc.pid)  # started by the server's engine core
        worker = children[0] if children else None
        time.sleep(0.05)
    assert worker is not None
    worker.send_signal(signal.SIGKILL)
    start = time.monotonic()
    assert proc.wait(timeout=30) != 0
    assert time.monotonic() - start < 30
    assert not _workers_left(tag)


def test_server_with_tp2_answers_the_openai_client_and_a_dead_rank_gives_503(llama_dir):
    prompt = random_prompts(1, [40], seed=5)[0]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(llama_dir), max_total_tokens=4096, **CPU) as llm:
        want = llm.generate(prompt, params)[0]
    server = Server(
        llama_dir, "--max-total-tokens", "4096", "--tp-size", "2", "--log-level", "info",
        "--device", "cpu",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        kw = dict(model=llama_dir.name, prompt=prompt, max_tokens=10, temperature=0)
        kw["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(logprobs=2, **kw)
        assert whole.choices[0].text == want.text
        assert whole.choices[0].logprobs.token_logprobs == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=1e-4
        )
        chunks = client.completions.create(stream=True, **kw)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        many = client.completions.create(n=3, seed=1, **{**kw, "temperature": 1.0})
        assert [c.index for c in many.choices] == [0, 1, 2]
        chat = client.chat.completions.create(
            model=llama_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.choices[0].message.role == "assistant"
        metrics = http.get(f"{server.url}/metrics").text
        assert re.search(r"tierserve_cached_tokens_total\{tier=\"device\"\}", metrics)

        assert "KV cache plan" in server.log_tail(10**6)  # printed when a start goes ahead

        workers = _ranks_of(server.proc.pid)
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGKILL)
        body = {"model": llama_dir.name, "prompt": prompt, "max_tokens": 10}
        status = http.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code
        assert status == 503
        assert server.proc.wait(timeout=30) != 0  # it exits for its supervisor, never hangs
        assert "tensor-parallel rank 1 was killed by SIGKILL" in server.log_tail(10**6)
    finally:
        server.stop()


# --- one host copy per node, measured -------------------------------------------------------

FAT_KV = {  # KV of several KB per token, so the host tier's bytes stand out of the processes'
    "llama": dict(head_dim=512, num_hidden_layers=4),  # kv_heads 2: replicated at TP 4
    "deepseek-v3": dict(kv_lora_rank=1984),  # the latent: the same on both ranks at TP 2
}


def _rank_procs(llm: LLM) -> list[psutil.Process]:
    return [psutil.Process(), *(psutil.Process(w.pid) for w in llm.engine.ranks.workers)]


def private_bytes(llm: LLM) -> int:
    """Every rank's memory that no other process maps, outside the shared host segments."""
    return sum(
        m.private_clean + m.private_dirty
        for p in _rank_procs(llm)
        for m in p.memory_maps()
        if "/dev/shm/tierserve-" not in m.path
    )


def shared_segment_pss(llm: LLM) -> int:
    maps = [m for p in _rank_procs(llm) for m in p.memory_maps()]
    return sum(m.pss for m in maps if "/dev/shm/tierserve-" in m.path)


def fill_host(llm: LLM) -> tuple[list[list[int]], int]:
    """Prompts of 6,000 tokens in all, each written through to the host tier; the outputs and
    the host bytes one copy holds."""
    prompts = random_prompts(24, [250], seed=70)
    # One token each: prefill only, so the CPU decode workspace (sized by the decode batch)
    # does not grow in the measurement.
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    llm.generate([3, 4, 5], SamplingParams(max_tokens=1))  # a step that issues the last copies
    written = llm.engine.kv.host.stats.host_written_tokens * llm.engine.kv_plan.spec.bytes_per_token
    return [o.token_ids for o in outs], written


@pytest.mark.parametrize(("family", "tp", "groups"), [("llama", 4, 2), ("deepseek-v3", 2, 1)])
def test_the_host_tier_is_one_copy_per_node(tmp_path, family, tp, groups):
    path = make_checkpoint(tmp_path / family, family, **FAT_KV[family])
    common = dict(
        **CPU, tp_size=tp, max_total_tokens=8192, enable_hierarchical_cache=True, hicache_ratio=2
    )
    runs = {}
    for shared in (True, False):
        with LLM(str(path), disable_shared_host_copy=not shared, **common) as llm:
            llm.generate([3, 4, 5], SamplingParams(max_tokens=1))  # first-step costs go first
            before = private_bytes(llm)
            outputs, written = fill_host(llm)
            grown = private_bytes(llm) - before
            segments = shared_segment_pss(llm)
            host = llm.engine.kv_plan.host
            metrics = parse_prometheus(ServerMetrics().render(engine_metrics(llm.engine)).decode())
            node = metrics["tierserve_kv_bytes{scope=node,tier=host}"]
            assert node == host.pool_bytes * (groups if shared else tp)  # each copy once
            assert metrics["tierserve_kv_bytes{scope=rank,tier=host}"] * tp == node
        runs[shared] = (outputs, written, grown, segments)
    (out_shared, written, grown_shared, segments), (out_apart, _, grown_apart, none) = (
        runs[True],
        runs[False],
    )
    assert out_shared == out_apart and written > 60 * 2**20
    # Shared: the segments hold each group's copy once, whichever ranks mapped which pages.
    assert segments == pytest.approx(written * groups, rel=0.05) and none == 0
    # Apart, every rank's copy is its own memory; shared, no rank keeps one beside the
    # segments. Private memory also grows by prefill temporaries the allocators keep, which
    # varied from 35 to 100 MB over the four ranks between runs; they only add, so the first
    # bound is safe from them and the second leaves them a quarter of the copies.
    assert grown_apart > 0.9 * written * tp, (grown_apart, written)
    assert grown_shared < 0.75 * written * tp, (grown_shared, written)


def test_two_nodes_meet_on_loopback(llama_dir):
    """--nnodes / --node-rank / --dist-init-addr: node 1's process joins node 0's group, runs
    rank 1 without HTTP, and leaves when rank 0 closes (one machine: rendezvous and flags)."""
    prompts = random_prompts(3, [20, 50], seed=9)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(llama_dir), max_total_tokens=2048, **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    addr = f"127.0.0.1:{free_port()}"
    dist = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    cmd = serve_cmd(llama_dir, "--device", "cpu")
    node1 = subprocess.Popen([*cmd, *dist, "--node-rank", "1", "--max-total-tokens", "2048"])
    try:
        kw = dict(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        with LLM(str(llama_dir), max_total_tokens=2048, **CPU, **kw) as llm:
            assert llm.engine.ranks.workers == []  # one rank per node: nobody to start here
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert node1.wait(timeout=30) == 0
    finally:
        node1.kill()


@pytest.mark.xdist_group("timeouts")  # a 5 s watchdog: never beside another short timeout
def test_a_stopped_rank_trips_the_watchdog_503_and_exit(llama_dir):
    """SIGSTOP (not SIGKILL) on the worker: its sockets stay open, so rank 0's collective would
    wait; past --watchdog-timeout, /health and the request in flight answer 503 and the server
    exits non-zero, leaving no rank behind."""
    server = Server(
        llama_dir, "--max-total-tokens", "4096", "--tp-size", "2", "--device", "cpu",
        "--watchdog-timeout", "5",
    )  # fmt: skip
    try:
        assert http.get(f"{server.url}/health").status_code == 200
        (worker,) = _ranks_of(server.proc.pid)
        worker.send_signal(signal.SIGSTOP)
        # /health is polled from now until the port closes, so its 503 is seen whenever the
        # watchdog fires, not only if the test asks at the right moment.
        health: list[int] = []
        poller = threading.Thread(target=_poll_health, args=(server.url, health), daemon=True)
        poller.start()
        body = {"prompt": [5] * 20, "max_tokens": 50, "ignore_eos": True}
        reply = http.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503 and "no engine step completed" in reply.text
        assert server.proc.wait(timeout=60) != 0
        poller.join(timeout=30)
        assert 503 in health and health[0] == 200, health
        assert not _still_running([worker.pid], within_s=10)
    finally:
        server.stop()


def _poll_health(url: str, seen: list[int]) -> None:
    """Each /health status until the server stops answering (bounded: 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            seen.append(http.get(f"{url}/health", timeout=5).status_code)
        except httpx.TransportError:
            return
        time.sleep(0.02)


# --- one group per process; no rank outlives a close, a failed start or its parent ----------

GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _my_workers() -> list[psutil.Process]:
    """Rank processes this (test) process started and that still run."""
    return _ranks_of(os.getpid())


def _still_running(pids: list[int], within_s: float) -> list[int]:
    """The pids still running after up to `within_s` seconds of polling."""
    deadline = time.monotonic() + within_s
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _group_released() -> bool:
    return not dist.is_initialized() and tp_group() == TPGroup()


def _record_spawns(monkeypatch) -> list[int]:
    pids: list[int] = []
    spawn = node_start._spawn

    def recording(*args: object) -> subprocess.Popen:
        proc = spawn(*args)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(node_start, "_spawn", recording)
    return pids


def test_a_tp_engine_after_a_closed_one_in_the_same_process(llama_dir):
    prompts = random_prompts(4, [20, 45], seed=11)
    with LLM(str(llama_dir), **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY8)]
    cores = os.sched_getaffinity(0)
    first = LLM(str(llama_dir), tp_size=2, **CPU)
    at_2 = [o.token_ids for o in first.generate(prompts, GREEDY8)]
    # The offline ranks split every core (each its own where there are two), and this
    # process, rank 0, gets its own back when the engine closes.
    split = plan_placement("auto", None, 2, sorted(cores), serving=False).ranks
    (worker,) = first.engine.ranks.workers
    seen = [os.sched_getaffinity(0), os.sched_getaffinity(worker.pid)]
    assert seen == [set(c) or cores for c in split], (seen, split)
    first.close()
    assert _group_released() and os.sched_getaffinity(0) == cores
    with LLM(str(llama_dir), tp_size=4, **CPU) as second:  # was: "initialize ... twice!"
        assert len(second.engine.ranks.workers) == 3
        first.close()  # idempotent: the group the second engine made is not the first's
        at_4 = [o.token_ids for o in second.generate(prompts, GREEDY8)]
    assert at_2 == want and at_4 == want
    assert _group_released() and not _still_running([p.pid for p in _my_workers()], 5)


START_NODE = """
import sys
from tierserve.args import EngineArgs
from tierserve.distributed import start_node
node = start_node(EngineArgs(model=sys.argv[1], tp_size=2, device="auto"), True, spawn_ranks=True)
assert node.ranks is not None and len(node.ranks.workers) == 1, node
assert node.args.cpu_omp_threads_bind != "auto"  # the placement's lists travel to the rank
node.ranks.release(wait_s=0.0)
"""


def test_an_engine_core_starts_its_ranks_before_its_torch_loads(llama_dir):
    """The engine core's first step: the node's placement and its other ranks, with no torch
    in the process yet, so that the ranks' imports run beside its own (it once spawned them
    after its ~2.7 s of imports)."""
    assert "torch" not in modules_after(START_NODE, str(llama_dir))


def test_a_second_tp_engine_while_one_is_open_is_refused_before_any_rank_starts(
    llama_dir, monkeypatch
):
    with LLM(str(llama_dir), tp_size=2, **CPU) as first:
        before = {p.pid for p in _my_workers()}
        spawned = _record_spawns(monkeypatch)
        message = r"already open in this process \(tp_size 2\); close it first: llm.close\(\)"
        with pytest.raises(TierserveError, match=message):
            LLM(str(llama_dir), tp_size=2, **CPU)
        assert spawned == [] and {p.pid for p in _my_workers()} == before and len(before) == 1
        assert first.generate([3, 4, 5], GREEDY8)[0].token_ids  # the first is untouched
    assert not _still_running(list(before), 5)


def test_an_llm_dropped_without_close_stops_its_ranks_and_leaves_the_group(llama_dir):
    llm = LLM(str(llama_dir), tp_size=2, **CPU)
    pids = [w.pid for w in llm.engine.ranks.workers]
    assert pids and all(running(pid) for pid in pids)
    del llm
    gc.collect()
    assert not _still_running(pids, 10)
    assert _group_released()


def _fail_load(monkeypatch) -> None:
    def load_model(*args: object) -> None:
        raise RuntimeError("injected: the weights do not load on rank 0")

    monkeypatch.setattr(engine_module, "load_model", load_model)


def _fail_rendezvous(monkeypatch) -> None:
    def init_process_group(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: rank 0 cannot open the rendezvous")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)


@pytest.mark.parametrize(
    ("failure", "error", "match"),
    [
        ("refused", TierserveError, "exceeds the model's max_position_embeddings"),
        ("load", RuntimeError, "the weights do not load on rank 0"),
        ("rendezvous", RuntimeError, "rank 0 cannot open the rendezvous"),
    ],
)  # after the ranks were spawned: in Ranks.agree, after it (rank 0 only), in the rendezvous
def test_a_start_that_fails_after_spawning_leaves_no_rank(
    llama_dir, monkeypatch, failure, error, match
):
    spawned = _record_spawns(monkeypatch)
    extra: dict[str, object] = {}
    if failure == "refused":
        extra["context_length"] = 10**9
    else:
        {"load": _fail_load, "rendezvous": _fail_rendezvous}[failure](monkeypatch)
    with pytest.raises(error, match=match):
        LLM(str(llama_dir), tp_size=2, **CPU, **extra)
    assert len(spawned) == 1
    assert not _still_running(spawned, 5)
    assert _group_released()
    monkeypatch.undo()
    with LLM(str(llama_dir), tp_size=2, **CPU) as llm:  # the process is free for the next
        assert llm.generate([3, 4, 5], GREEDY8)[0].token_ids


PARENT_SCRIPT = """
import socket, sys, time
kw = {}
if sys.argv[2] == "rendezvous":  # rank 0 holds a store that never answers: rank 1 waits in it
    import torch.distributed as dist

    store = socket.create_server(("127.0.0.1", 0))
    kw["dist_init_addr"] = f"127.0.0.1:{store.getsockname()[1]}"

    def init_process_group(*args, **kwargs):
        store.accept()
        print("ready", flush=True)
        time.sleep(600)

    dist.init_process_group = init_process_group
from tierserve import LLM
llm = LLM(sys.argv[1], tp_size=2, device="cpu", **kw)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("when", ["serving", "rendezvous", "stopped"])
def test_ranks_die_with_a_parent_killed_by_sigkill(llama_dir, when):
    """Stopped: a rank that runs no code of its own (as one whose main thread holds the GIL in
    C++) still dies with its parent, which a thread polling for the parent could not do."""
    if when == "stopped" and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's; elsewhere a thread polls")
    mode = "rendezvous" if when == "rendezvous" else "serving"
    cmd = [sys.executable, "-c", PARENT_SCRIPT, str(llama_dir), mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 1
        if when == "stopped":
            workers[0].send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert not _still_running([w.pid for w in workers], 5)
    finally:
        proc.kill()
        proc.wait()
