"""The engine core in its own process: what the API process keeps doing while the core is busy,
and how the server ends when the core dies, hangs or fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import Server, eventually, http, running, serve_cmd
from tierserve.bench.client import parse_prometheus
from tierserve.distributed import ENV_PARENT
from tierserve.engine import CORE_MODULE, STEP_HOLD_ENV
from tierserve.utils import free_port


def _stream(url: str, body: dict, seen: list[dict]) -> None:
    """The events of one streamed completion, into `seen` (a 503 arrives as an error event)."""
    with http.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        seen.extend(json.loads(line[6:]) for line in reply.iter_lines() if line[6:7] == "{")


def test_the_core_is_its_own_process_and_killing_it_is_a_503_and_exit_1(llama_dir):
    server = Server(llama_dir, "--max-total-tokens", "4096")
    try:
        core = server.core
        assert core.pid != server.proc.pid and core.is_running()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="llama", prompt=[5] * 8, max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4  # served through the core

        server.hold_steps(3)  # a stream that has started and cannot finish before the kill
        seen: list[dict] = []
        body = {"prompt": [5] * 8, "max_tokens": 50, "stream": True, "ignore_eos": True}
        streaming = threading.Thread(target=_stream, args=(server.url, body, seen))
        streaming.start()
        server.wait_for(lambda m: m["tierserve_num_requests_running"] == 1)
        core.send_signal(signal.SIGKILL)
        streaming.join(timeout=60)
        assert seen and seen[-1]["error"]["code"] == 503, seen
        with pytest.raises(openai.InternalServerError) as refused:  # 503 at once, no hang
            client.completions.create(model="llama", prompt=[5] * 8, max_tokens=4, timeout=30)
        assert refused.value.status_code == 503
        assert http.post(f"{server.url}/flush_cache", timeout=30).status_code == 503
        assert server.proc.wait(timeout=60) == 1
        assert "exited with status -9" in server.log_tail(4000)
    finally:
        server.stop()


def test_health_answers_while_a_step_is_held_open(llama_dir, tmp_path):
    """The API process serves /health from its own event loop and GIL while the core is inside
    a step (held there by the test's hook), and the step then completes as usual."""
    hold = tmp_path / "hold"
    server = Server(
        llama_dir, "--max-total-tokens", "4096", "--watchdog-timeout", "120",
        env={STEP_HOLD_ENV: str(hold)},
    )  # fmt: skip
    try:
        hold.touch()
        result: list[openai.types.Completion] = []
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        def complete() -> None:
            kw = dict(model="llama", prompt=[7] * 8, max_tokens=5, temperature=0)
            result.append(client.completions.create(**kw))

        request = threading.Thread(target=complete)
        request.start()
        held = Path(f"{hold}.held")
        assert eventually(held.exists, within_s=60), server.log_tail()
        for _ in range(20):  # the step is still held: only the test ends it
            assert http.get(f"{server.url}/health", timeout=10).status_code == 200
        assert request.is_alive()
        hold.unlink()
        request.join(timeout=60)
        assert result and result[0].usage.completion_tokens == 5
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_step_held_past_the_watchdog_is_a_503_and_exit_1(llama_dir, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()  # never removed: the first step never ends
    server = Server(
        llama_dir, "--max-total-tokens", "4096", "--watchdog-timeout", "2",
        env={STEP_HOLD_ENV: str(hold)},
    )  # fmt: skip
    try:
        core = server.core
        body = {"prompt": [5] * 8, "max_tokens": 5}
        reply = http.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503 and "no engine step completed in 2 s" in reply.text
        assert Path(f"{hold}.held").exists()  # it was the held step that tripped it
        assert server.proc.wait(timeout=60) == 1
        assert eventually(lambda: not core.is_running(), within_s=10)
    finally:
        server.stop()


def test_a_stopped_core_trips_the_watchdog_outside_a_step(llama_dir):
    """SIGSTOP on an idle core: no step runs, but the request sent to it goes unanswered, and
    past --watchdog-timeout the server ends as for a hung step."""
    server = Server(llama_dir, "--max-total-tokens", "4096", "--watchdog-timeout", "2")
    try:
        core = server.core
        core.send_signal(signal.SIGSTOP)
        body = {"prompt": [5] * 8, "max_tokens": 5}
        reply = http.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503 and "no engine step completed in 2 s" in reply.text
        assert server.proc.wait(timeout=60) == 1
        assert eventually(lambda: not core.is_running(), within_s=10)
    finally:
        server.stop()


# The fault a test cannot cause through the API, in the core's process: a bug in a step. The
# server's environment puts this directory on PYTHONPATH, so every process it starts runs it.
FAULTY_STEP = """
from tierserve.engine.engine import Engine

real_step = Engine.step


def step_then_fail(self):
    if self.scheduler.stats.num_steps >= 3:
        raise RuntimeError("injected fault")
    return real_step(self)


Engine.step = step_then_fail
"""


def test_a_core_that_fails_answers_503_and_the_server_exits_1(llama_dir, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULTY_STEP)
    server = Server(llama_dir, env={"PYTHONPATH": str(tmp_path)})
    try:
        seen: list[dict] = []
        body = {"prompt": [5] * 8, "max_tokens": 50, "stream": True, "ignore_eos": True}
        _stream(server.url, body, seen)
        assert seen[-1]["error"]["code"] == 503, seen[-1]
        # One sentence for the client; the exception's text (paths, peers) only in the log.
        message = seen[-1]["error"]["message"]
        assert "engine core failed" in message and "injected fault" not in message, message
        assert message.count("failed") == 1, message
        assert server.proc.wait(timeout=60) == 1  # a supervisor sees a failure and restarts it
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "engine loop failed" in log and "injected fault" in log


@pytest.mark.parametrize(
    "case", ["tiny-pool", "no-model", "no-tokenizer", "port-in-use", "cores-not-ours"]
)
def test_a_refused_start_exits_2_and_leaves_no_core(llama_dir, tmp_path, case):
    """The core refuses the flags and says why; the server exits 2 before listening, and waits
    for its core first. The API process loads its tokenizer while the core starts, yet the
    core's verdict is the one reported (a missing model is not a tokenizer error), and a
    checkpoint without tokenizer files is one line naming --tokenizer. A port another process
    listens on is refused before any core starts."""
    model, flags, says = llama_dir, ["--max-total-tokens", "8"], "max_total_tokens"
    if case == "no-model":
        model, flags, says = tmp_path / "absent", [], "model directory not found"
    elif case == "no-tokenizer":
        for name in ("config.json", "model.safetensors"):
            (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
        model, flags, says = tmp_path, [], "--tokenizer"
    elif case == "port-in-use":
        flags, says = [], "cannot listen on 127.0.0.1:"
    elif case == "cores-not-ours":
        flags, says = ["--cpu-omp-threads-bind", "4096"], "are outside the"
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), *flags]
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1] if case == "port-in-use" else free_port()
        proc = subprocess.Popen(cmd + ["--port", str(port)], stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr and says in stderr.strip().splitlines()[-1], stderr
    assert not [p for p in psutil.process_iter() if _core_of(p, proc.pid)]


def _core_of(process: psutil.Process, server_pid: int) -> bool:
    try:
        return CORE_MODULE in process.cmdline() and process.environ().get(ENV_PARENT) == str(
            server_pid
        )
    except psutil.Error:
        return False


def test_ctrl_c_drains_and_exits_0_leaving_no_process(llama_dir, tmp_path):
    """A terminal's Ctrl-C is SIGINT to the whole process group: the API process, the core and
    the ranks all get it. The core and the ranks ignore it; the server drains, stops them in
    order and exits 0, with no traceback."""
    port = free_port()
    cmd = serve_cmd(llama_dir, "--port", str(port), "--tp-size", "2", "--device", "cpu")
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert eventually(lambda: _healthy(url), within_s=180), (
            tmp_path / "server.log"
        ).read_text()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the core and its rank (and any compile process)
        body = {"prompt": [5] * 8, "max_tokens": 4}
        assert http.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert eventually(lambda: not any(running(p.pid) for p in children), within_s=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "Traceback" not in text and "rank exited" not in text, text[-3000:]


def _healthy(url: str) -> bool:
    try:
        return http.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _core_messages(llama_dir, steps: int) -> list[list[tuple[int, ...]]]:
    """The tokens of each StepOutputs message an in-process engine core sends for one greedy
    request of 17 tokens, with --num-continuous-decode-steps `steps` (a real pipe)."""
    import tempfile
    from multiprocessing import Pipe

    from tierserve.args import EngineArgs
    from tierserve.core_messages import AddRequest, Shutdown, StepOutputs, decode_output, encode
    from tierserve.engine.core import EngineCore
    from tierserve.engine.core_hooks import StepClock
    from tierserve.engine.engine import Engine
    from tierserve.sampling_params import SamplingParams

    args = EngineArgs(str(llama_dir), max_total_tokens=1024, num_continuous_decode_steps=steps)
    ours, theirs = Pipe()
    with tempfile.TemporaryFile() as clock_file:
        core = EngineCore(Engine(args), theirs, StepClock(clock_file.fileno()))
        loop = threading.Thread(target=core.run)
        loop.start()
        params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
        ours.send_bytes(encode(AddRequest("r", 0, [5, 6, 7, 8] * 4, params)))
        messages, tokens = [], 0
        while tokens < 17:
            assert ours.poll(300), "the core sent nothing"  # bounds a dead core's hang only
            message = decode_output(ours.recv_bytes())
            if isinstance(message, StepOutputs) and message.outputs:
                messages.append([o.token_id for o in message.outputs])
                tokens += len(message.outputs)
        ours.send_bytes(encode(Shutdown()))
        loop.join(timeout=60)
        assert not loop.is_alive()
    return messages


def test_continuous_decode_steps_send_n_tokens_a_message(llama_dir):
    """SGLang's --num-continuous-decode-steps 4: the core runs four decode steps before it
    reads new requests and reports, so a request's 17 tokens come in 5 messages, not 17, and
    are the same tokens."""
    one, four = _core_messages(llama_dir, 1), _core_messages(llama_dir, 4)
    assert [len(m) for m in one] == [1] * 17
    assert [len(m) for m in four] == [4, 4, 4, 4, 1]
    assert [t for m in four for t in m] == [t for m in one for t in m]


def _streamed_17(llama_dir: Path, *flags: str) -> list[int]:
    """A 17-token completion streamed from a server with `flags`: each chunk's token count,
    after checking that the chunks hold the text and tokens of the same request unstreamed."""
    with Server(llama_dir, "--max-total-tokens", "1024", *flags) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        ask = dict(model="llama", prompt=[5, 6, 7, 8] * 4, max_tokens=17, temperature=0)
        ask |= dict(logprobs=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**ask).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    return [len(c.logprobs.tokens) for c in chunks if c.logprobs and c.logprobs.tokens]


def test_continuous_decode_steps_stream_n_tokens_a_chunk(llama_dir):
    """Served with --num-continuous-decode-steps 4, a stream gets each message's four tokens
    as one chunk (a request's outputs join while its stream has not taken them, as vLLM's
    do): 17 tokens in chunks of whole messages, four tokens each and one last (a chunk holds
    several when the API process fell behind), the text and tokens of the whole completion."""
    sizes = _streamed_17(llama_dir, "--num-continuous-decode-steps", "4")
    assert sum(sizes) == 17 and sizes[-1] % 4 == 1, sizes
    assert all(n % 4 == 0 for n in sizes[:-1]), sizes


def test_a_stream_interval_streams_n_tokens_a_chunk(llama_dir):
    """Served with --stream-interval 5 (vLLM's and SGLang's flag), a stream of 17 tokens
    comes as the first token, then chunks of at least five (more when the API process fell
    behind), then the rest: at most 5 chunks where each token was one; the same text and
    tokens as the whole completion."""
    sizes = _streamed_17(llama_dir, "--stream-interval", "5")
    assert len(sizes) <= 5 and sum(sizes) == 17  # the exact rule: test_sampling.py's
    assert all(n >= 5 for n in sizes[1:-1]), sizes


def test_the_warm_up_runs_its_shapes_and_leaves_nothing(llama_dir, offline, tmp_path, caplog):
    """A served engine's warm-up (the offline LLM asks for it here): the running cap's decode
    rows and a whole prefill chunk run, then the counters start from 0, the pool is free, the
    tree holds nothing, nothing is captured or stored, and outputs equal an engine's without it."""
    import logging

    from tierserve import LLM, SamplingParams

    store = tmp_path / "store"
    extra = json.dumps({"path": str(store)})
    with caplog.at_level(logging.INFO, logger="tierserve"):
        llm = LLM(
            str(llama_dir), max_total_tokens=4096, max_running_requests=32,
            chunked_prefill_size=2048,  # the server's budget (offline on CPU: 4096)
            skip_server_warmup=False, hidden_states_dir=str(tmp_path / "hs"),
            enable_hierarchical_cache=True, hicache_storage_backend="file",
            hicache_storage_backend_extra_config=extra,
        )  # fmt: skip
    # the whole chunk budget (2,048) over prompts no longer than the context allows (2,047 + 1)
    assert "warm-up: a decode step of 32 rows and a 2048-token prefill" in caplog.text
    engine = llm.engine
    assert engine.scheduler.stats.num_steps == 0 and engine.peak_running == 0
    assert engine.kv.cached_pages() == 0 and engine.kv.allocator.num_free == engine.kv.num_pages
    assert engine.storage is not None and engine.storage.flush_writes()
    assert not any((tmp_path / "hs").glob("*")) and not list(store.glob("??/*"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in offline.generate(prompts, params)]
    assert engine.scheduler.stats.num_steps > 0
    assert engine.storage.flush_writes() and list(store.glob("??/*"))  # real requests store
    assert any((tmp_path / "hs").glob("*"))  # and are captured
    llm.close()


def test_a_reused_rid_never_gets_the_aborted_requests_tokens(server):
    """A client drops a /generate stream and at once retries with the same rid. The core is
    held from reading messages (the test's intake hook), so it still steps the dropped
    request and sends its tokens after the retry has arrived: the retry waits until the core
    has applied the abort, then gets its own tokens, exactly as many as it asked for."""
    prompt = list(range(40, 60))
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    fresh = {"input_ids": prompt, "sampling_params": params}
    want = http.post(f"{server.url}/generate", json=fresh, timeout=60).json()["output_ids"]
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    old = {"input_ids": [7] * 12, "rid": "again", "stream": True, "sampling_params": long}
    held = Path(f"{server.intake}.held")
    retry: list[dict] = []
    try:
        with http.stream("POST", f"{server.url}/generate", json=old, timeout=60) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
            first = [next(lines) for _ in range(3)]
            server.intake.touch()
            assert eventually(held.exists, within_s=60), server.log_tail()
            steps_at_hold = int(held.read_text())
        # The stream is closed: its abort waits in the held core, which steps the old request on.
        again = {"input_ids": prompt, "rid": "again", "sampling_params": params}

        def send() -> None:
            retry.append(http.post(f"{server.url}/generate", json=again, timeout=120).json())

        sender = threading.Thread(target=send)
        sender.start()
        assert eventually(lambda: _waiting_for_id(server) == 1, within_s=60)
        # The old request's tokens after the retry arrived: what reached the wrong stream.
        assert eventually(lambda: int(held.read_text()) >= steps_at_hold + 3, within_s=60)
        assert sender.is_alive()  # it waits for the id, not on the old request's tokens
    finally:
        server.intake.unlink(missing_ok=True)
    sender.join(timeout=120)
    assert len(first) == 3 and retry and retry[0]["output_ids"] == want
    assert _waiting_for_id(server) == 0


def _waiting_for_id(server: Server) -> float:
    """The API process's own gauge: a scrape answers it while the core is held (its families
    come stale then)."""
    families = parse_prometheus(http.get(f"{server.url}/metrics", timeout=60).text)
    return families["tierserve_requests_waiting_for_id"]
