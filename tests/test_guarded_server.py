"""A capturing server with an API key, as a hostile user meets it: the routes open without the
key, what /server_info never says, health probes that capture nothing, chat-template arguments
a client may not steer, SGLang's /generate fields, a capture directory that vanishes or runs out
of inodes, and the routes that report the core's state while the core is stopped. One server
for the module (its capture directory a tmpfs with few inodes where this machine can mount one),
ordered by the server's own counters and the step gate, never by how fast it runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, eventually, http
from tierserve.bench.client import parse_prometheus
from tierserve.bench.replicas import Router
from tierserve.server.worker_info import STALE_HEADER

KEY = "sesame-7781"
PLANTED = "planted-secret-4417"
AUTH = {"authorization": f"Bearer {KEY}"}
WRITTEN = "tierserve_hidden_states_files_total{outcome=written}"
FAILED = "tierserve_hidden_states_files_total{outcome=failed}"
KEYED_ROUTES = [
    "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load",
    "/get_loads", "/docs", "/redoc", "/openapi.json", "/v1/models",
]  # fmt: skip
INODES = 48


class Guarded(Server):
    def __init__(self, model: Path, root: Path) -> None:
        self.mnt = root / "mnt"  # the capture directory's filesystem
        self.mnt.mkdir()
        self.tmpfs = _mount_tmpfs(self.mnt)
        self.hs = self.mnt / "hs"
        self.hs.mkdir()
        extra = {"path": str(root / "kv"), "namespace": PLANTED}  # a salt: as secret as a key
        super().__init__(
            model,
            "--api-key", KEY,
            "--hidden-states-dir", str(self.hs),
            "--hidden-states-layers", "0,1",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--watchdog-timeout", "600",
        )  # fmt: skip

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return http.post(f"{self.url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def _mount_tmpfs(path: Path) -> bool:
    """A tmpfs of INODES inodes at `path`, where this machine lets the test mount one (root)."""
    cmd = ["mount", "-t", "tmpfs", "-o", f"size=16m,nr_inodes={INODES}", "tmpfs", str(path)]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def guarded(llama_dir) -> Iterator[Guarded]:
    root = Path(tempfile.mkdtemp())
    server = Guarded(llama_dir, root)
    yield server
    server.stop()
    if server.tmpfs:
        subprocess.run(["umount", "-l", str(server.mnt)], capture_output=True, timeout=30)
    shutil.rmtree(root, ignore_errors=True)


def capture(server: Guarded, prompt: list[int]) -> httpx.Response:
    return server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})


def chat(server: Guarded, path: str = "/v1/chat/completions", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return server.post(path, {"return_hidden_states": False, **body})


# --- the key and what the server says of itself ---------------------------------------------


def test_every_route_but_health_and_metrics_needs_the_key(guarded):
    for route in KEYED_ROUTES:
        assert http.get(f"{guarded.url}{route}").status_code == 401, route
        assert http.get(f"{guarded.url}{route}", headers=AUTH).status_code == 200, route
    for route in ("/health", "/metrics"):
        assert http.get(f"{guarded.url}{route}").status_code == 200, route
    assert http.post(f"{guarded.url}/flush_cache").status_code == 401


def test_a_planted_secret_never_appears_in_any_response(guarded):
    seen = [http.get(f"{guarded.url}{route}", headers=AUTH).text for route in KEYED_ROUTES]
    seen += [http.get(f"{guarded.url}{r}").text for r in ("/health", "/metrics")]
    seen.append(chat(guarded).text)
    assert all(PLANTED not in text for text in seen)
    info = http.get(f"{guarded.url}/server_info", headers=AUTH).json()
    assert info["hicache_storage_backend_extra_config"] == {
        "path": "<redacted>",
        "namespace": "<redacted>",
    }
    assert info["hidden_states_dir"] == "<redacted>"
    assert info["model_path"] and info["dp_size"] == 1  # what a router reads is still there


def test_sglang_router_given_the_key_registers_and_routes_to_the_worker(guarded, tmp_path):
    router = Router([guarded.url], "round_robin", tmp_path / "router.log", api_key=KEY)
    try:
        (worker,) = router.workers()
        assert worker["is_healthy"] and worker["metadata"]["dp_size"] == "1"  # read with the key
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        body["return_hidden_states"] = False
        reply = http.post(f"{router.url}/generate", json=body, headers=AUTH, timeout=60)
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 2
    finally:
        router.stop()


# --- health probes --------------------------------------------------------------------------


def test_500_unauthenticated_probes_add_no_file(guarded):
    before = sorted(os.listdir(guarded.hs))
    written = guarded.metrics()[WRITTEN]

    async def probes() -> list[int]:
        async with httpx.AsyncClient(base_url=guarded.url, timeout=120) as h:
            gate = asyncio.Semaphore(25)

            async def one() -> int:
                async with gate:
                    return (await h.get("/health_generate")).status_code

            return await asyncio.gather(*(one() for _ in range(500)))

    assert set(asyncio.run(probes())) == {200}
    assert sorted(os.listdir(guarded.hs)) == before
    assert guarded.metrics()[WRITTEN] == written


# --- chat-template arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokenize": True}, None),
        ({"conversation": []}, "messages"),
        ({"tools": 5}, "tools"),
        ({"documents": "x"}, "documents"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_template_parameters_in_chat_template_kwargs_are_400s_naming_them(
    guarded, kwargs, field, path
):
    reply = chat(guarded, path, chat_template_kwargs=kwargs)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    (key,) = kwargs
    assert repr(key) in message
    assert (f"top-level field {field!r}" in message) if field else "tierserve sets it" in message


def test_keys_the_template_never_reads_are_dropped_and_a_client_template_is_refused(guarded):
    plain = chat(guarded, "/v1/chat/completions/render").json()["token_ids"]
    thinking = chat(
        guarded, "/v1/chat/completions/render", chat_template_kwargs={"enable_thinking": True}
    )
    assert thinking.status_code == 200 and thinking.json()["token_ids"] == plain
    own = chat(guarded, chat_template="{{ 'a b ' * 2000000 }}")
    assert own.status_code == 400 and "--trust-request-chat-template" in own.text
    bad_tools = chat(guarded, tools=[{"type": "function", "function": {"description": "x"}}])
    assert bad_tools.status_code == 400 and "tools.0.function.name" in bad_tools.text


def test_a_render_past_the_context_is_a_400_before_tokenizing(guarded):
    """The messages alone are just under the context × 32 characters; rendered, they pass it."""
    limit = 2048 * 32  # the test model's context × the characters-per-token rule
    content = "a" * (limit - 4)
    reply = chat(guarded, messages=[{"role": "user", "content": content}])
    assert reply.status_code == 400
    assert "characters cannot fit in the context" in reply.json()["error"]["message"]


# --- SGLang's /generate fields --------------------------------------------------------------


def test_generate_honours_rid_and_return_hidden_states_with_strict_booleans(guarded):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1}}
    quiet = guarded.post("/generate", {**body, "rid": "quiet-1", "return_hidden_states": False})
    assert quiet.json()["meta_info"]["id"] == "quiet-1"
    assert "hidden_states_path" not in quiet.json()["meta_info"]
    kept = guarded.post("/generate", {**body, "rid": "kept-1", "return_hidden_states": True})
    assert kept.json()["meta_info"]["hidden_states_path"] == str(guarded.hs / "kept-1.safetensors")
    for bad in ({"return_hidden_states": "yes"}, {"stream": "yes"}, {"return_logprob": True}):
        reply = guarded.post("/generate", {**body, **bad})
        assert reply.status_code == 400 and next(iter(bad)) in reply.text, reply.text


def test_a_second_request_with_a_rid_in_flight_is_a_400(guarded):
    body = {"input_ids": [9] * 8, "rid": "twice", "return_hidden_states": False}
    body["sampling_params"] = {"max_new_tokens": 2}
    guarded.hold_steps(0)
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as h:
        first = asyncio.run(_send_and_check_second(guarded, h, body))
    assert first == 200


async def _send_and_check_second(guarded: Guarded, h: httpx.Client, body: dict) -> int:
    pending = asyncio.ensure_future(asyncio.to_thread(h.post, "/generate", json=body))
    try:
        await asyncio.to_thread(
            guarded.wait_for, lambda m: m["tierserve_num_requests_waiting"] == 1
        )
        second = await asyncio.to_thread(h.post, "/generate", json=body)
        assert second.status_code == 400 and "already in flight" in second.text
    finally:
        guarded.release_steps()
    return (await pending).status_code


# --- the core stopped -----------------------------------------------------------------------


def test_metrics_and_load_answer_marked_stale_while_the_core_is_stopped(guarded):
    guarded.metrics()  # the core's last answer, read fresh
    guarded.core.send_signal(signal.SIGSTOP)
    try:
        stale = parse_prometheus(http.get(f"{guarded.url}/metrics", timeout=30).text)
        assert stale["tierserve_engine_metrics_stale"] == 1
        assert stale["tierserve_engine_metrics_age_seconds"] > 0
        assert "tierserve_num_requests_running" in stale  # the core's last values
        load = http.get(f"{guarded.url}/get_load", headers=AUTH, timeout=30)
        assert load.status_code == 200 and load.json()[0]["num_reqs"] == 0
        assert float(load.headers[STALE_HEADER]) > 0  # the last known load, and its age
        assert http.get(f"{guarded.url}/health", timeout=30).status_code == 200
    finally:
        guarded.core.send_signal(signal.SIGCONT)
    assert guarded.metrics()["tierserve_engine_metrics_stale"] == 0  # fresh once it answers
    load_headers = lambda: http.get(f"{guarded.url}/get_load", headers=AUTH).headers  # noqa: E731
    assert eventually(lambda: STALE_HEADER not in load_headers(), 60)


# --- the capture directory breaks -----------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_directory_out_of_inodes_costs_files_not_the_server(guarded):
    if not guarded.tmpfs:
        pytest.skip("this machine mounts no tmpfs here")
    filler = [guarded.mnt / f"filler-{i}" for i in range(INODES)]
    for path in filler:
        try:
            path.touch()
        except OSError:  # out of inodes: what the test wants
            break
    replies = [capture(guarded, [20 + i] * 6).status_code for i in range(3)]
    assert set(replies) <= {200, 507} and 507 in replies, replies
    for path in filler:
        path.unlink(missing_ok=True)
    assert http.get(f"{guarded.url}/health").status_code == 200
    assert capture(guarded, [40] * 6).status_code == 200


def test_a_directory_replaced_by_a_file_costs_files_not_the_server(guarded):
    """The directory goes while a request waits inside the core (its 507 check passed): that
    request is answered without a file; later ones are 507s naming the directory."""
    failed = guarded.metrics()[FAILED]
    guarded.hold_steps(0)
    moved = guarded.mnt / "moved"
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as h:
        body = {"prompt": [30] * 6, "max_tokens": 1}
        pending = asyncio.run(_replace_while_waiting(guarded, h, body, moved))
    assert pending.status_code == 200 and "kv_transfer_params" not in pending.json()
    assert guarded.metrics()[FAILED] == failed + 1
    for i in range(3):
        reply = capture(guarded, [50 + i] * 6)
        assert reply.status_code == 507 and str(guarded.hs) in reply.text, reply.text
    assert http.get(f"{guarded.url}/health").status_code == 200
    guarded.hs.unlink()
    moved.rename(guarded.hs)
    assert capture(guarded, [60] * 6).status_code == 200


async def _replace_while_waiting(
    guarded: Guarded, h: httpx.Client, body: dict, moved: Path
) -> httpx.Response:
    pending = asyncio.ensure_future(asyncio.to_thread(h.post, "/v1/completions", json=body))
    try:
        await asyncio.to_thread(
            guarded.wait_for, lambda m: m["tierserve_num_requests_waiting"] == 1
        )
        guarded.hs.rename(moved)
        guarded.hs.write_text("a file where the directory was")
    finally:
        guarded.release_steps()
    return await pending


# --- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--hidden-states-dir", ""], "--hidden-states-dir needs a directory"),
        (["--hicache-storage-prefetch-policy", "timeout"], "--enable-hierarchical-cache"),
        (["--stream-interval", "0"], "stream_interval must be >= 1"),
    ],
)
def test_flags_that_would_start_a_broken_server_exit_2(llama_dir, flags, needle):
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(llama_dir), *flags]
    proc = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
