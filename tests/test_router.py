"""tierserve as a worker of the real sglang-router (`smg launch`): the router's worker discovery
finds SGLang's info endpoints, and requests sent to the router come back from the workers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import openai

import tierserve
from tests.conftest import Server, eventually
from tierserve.net import free_port

DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
SMG = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "smg"


def test_tierserve_workers_behind_sglang_router(tmp_path):
    with Server(DEMO_DIR, "--device", "cpu") as a, Server(DEMO_DIR, "--device", "cpu") as b:
        for worker in (a, b):  # what the router reads when a worker joins, as SGLang has it
            info = httpx.get(f"{worker.url}/get_server_info").json()
            assert info["model_path"] == str(DEMO_DIR) and info["dp_size"] == 1
            model = httpx.get(f"{worker.url}/model_info").json()
            assert model["architectures"] == ["LlamaForCausalLM"] and model["is_generation"]
        port = free_port()
        cmd = [str(SMG), "launch", "--worker-urls", a.url, b.url, "--policy", "cache_aware"]
        log = (tmp_path / "router.log").open("wb")
        cmd += ["--port", str(port), "--prometheus-port", str(free_port())]
        router = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                try:
                    return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            assert eventually(ready, 60), (tmp_path / "router.log").read_text()[-2000:]
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model=DEMO_DIR.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content is not None
            served = sum(w.metrics()["tierserve_generation_tokens_total"] for w in (a, b))
            assert served >= 1
            for worker in (a, b):  # the router found every info endpoint it asked for
                assert " 404 " not in worker.log_tail(10**6)
        finally:
            router.terminate()
            router.wait(timeout=30)
