"""int4 served against its peers on this CPU: tierserve (the compressed-tensors int4 g32
checkpoint on torch's int4 kernel), llama.cpp's `llama-server` (the same weights as GGUF Q4_0)
and vLLM's CPU build (the compressed-tensors checkpoint itself), decode throughput at 1 and 32
concurrent requests.

    .venv/bin/python benchmarks/int4_peers.py --llama-cpp DIR [--vllm-venv .venv-vllm]
        [--rounds 3] [--hidden 1024] [--layers 15] [--vocab 4096]

DIR is llama.cpp's source as the llama-cpp-python sdist vendors it (`pip download --no-binary
:all: --no-deps llama-cpp-python`, unpacked: `vendor/llama.cpp`), with `llama-server` built
in DIR/build/bin (`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
--target llama-server`): its gguf-py writes the GGUF file (benchmarks/gguf_q4.py).

The model is quantized.py's (a random-init Llama of ~236 M parameters in bf16, and the same
weights as compressed-tensors int4 g32 by compressed-tensors' own compressor, every linear but
the LM head). Each round starts every server fresh, in alternating order, one at a time:

- tierserve int4: `tierserve serve` on the int4 checkpoint, bf16 (activations into the kernel);
- tierserve bf16 dense: the dense checkpoint, the ratio's base;
- llama.cpp Q4_0: `llama-server -t 2 -np 32` (its 32 slots; llama.cpp's defaults otherwise);
- vLLM int4: vLLM's OpenAI server on the int4 checkpoint in bf16, at its default (a core kept
  for its scheduler) and with `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (every core).

On each, after a warm-up at each size, 1 and then 32 concurrent `/v1/completions` of 32
prompt token ids × 128 greedy tokens (EOS ignored), not streamed; output tokens/s = completion
tokens / wall time. Medians of the rounds; ratios are medians of the rounds' ratios to
tierserve bf16 dense.

Writes benchmarks/results/int4-peers/report.md and run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from gguf_q4 import write_gguf_q4_0  # beside this script: on sys.path
from omp_wait import cpu_model
from quantized import make_models
from vllm_peer import VllmServer, vllm_env, vllm_python

from tierserve.bench.server_process import ServerProcess

OUT = Path(__file__).parent / "results" / "int4-peers"
ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 32)
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 128


class LlamaServer(ServerProcess):
    """llama.cpp's `llama-server`, started and stopped as tierserve's is."""

    def __init__(self, binary: Path, gguf: str, flags: list[str], log: Path) -> None:
        self.binary = binary  # before the base class asks for the command
        super().__init__(gguf, flags, log, startup_timeout_s=300)

    def command(self, model: str, flags: Sequence[str]) -> list[str]:
        return [str(self.binary), "-m", model, "--port", str(self.port), *flags]


def prompts(n: int, seed: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + seed) % 4000 + 3 for j in range(PROMPT_TOKENS)] for i in range(n)]


def tok_s(url: str, model: str, n: int, seed: int) -> float:
    """`n` concurrent requests' output tokens a second."""

    def one(p: list[int]) -> int:
        body = {"model": model, "prompt": p, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(one, prompts(n, seed)))
        seconds = time.perf_counter() - start
    assert tokens == n * OUTPUT_TOKENS, (tokens, n)  # every request ran whole
    return tokens / seconds


def measure(server: ServerProcess, model: str) -> dict[int, float]:
    out = {}
    for n in SIZES:
        tok_s(server.url, model, n, seed=1000 + n)  # warm-up at this size, other prompts
        out[n] = tok_s(server.url, model, n, seed=0)
    return out


def servers(ns: argparse.Namespace, models: dict[str, Path], gguf: Path, logs: Path):
    """name → (a function starting the server, the model name its requests give)."""
    binary = ns.llama_cpp / "build" / "bin" / "llama-server"
    tier = ["--served-model-name", "m", "--dtype", "bfloat16", "--max-total-tokens", "16384"]
    llama = ["-t", str(os.cpu_count()), "-tb", str(os.cpu_count()), "-np", "32", "-c", "8192"]
    vllm = ["--dtype", "bfloat16", "--served-model-name", "m", "--seed", "0"]
    python = vllm_python(ns.vllm_venv)
    every_core = {**vllm_env(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    made: dict[str, tuple[Callable[[], ServerProcess], str]] = {
        "tierserve int4 g32": (
            lambda: ServerProcess(str(models["int4"]), tier, logs / "tier-int4.log", 600), "m"),
        "tierserve bf16 dense": (
            lambda: ServerProcess(str(models["bf16"]), tier, logs / "tier-bf16.log", 600), "m"),
        "llama.cpp Q4_0": (
            lambda: LlamaServer(binary, str(gguf), llama, logs / "llama.log"), "m"),
        "vLLM int4 (default)": (
            lambda: VllmServer(python, str(models["int4"]), vllm, logs / "vllm.log"), "m"),
        "vLLM int4 (every core)": (
            lambda: VllmServer(python, str(models["int4"]), vllm, logs / "vllm-all.log",
                               env=every_core), "m"),
    }  # fmt: skip
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=4096)
    ns = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = make_models(root, ns.hidden, ns.layers, ns.vocab)
        gguf = write_gguf_q4_0(models["bf16"], root / "q4_0.gguf", ns.llama_cpp)
        # The ~0.8 GB just written, flushed before any server runs: in a first run the
        # write-back overlapped the first server's rounds (30 tok/s where a later one gave 83).
        os.sync()
        made = servers(ns, models, gguf, root)  # server logs: with the models, not kept
        rows: dict[str, dict[int, list[float]]] = {name: {n: [] for n in SIZES} for name in made}
        refused: dict[str, str] = {}
        for r in range(ns.rounds):
            order = list(made) if r % 2 == 0 else list(made)[::-1]
            for name in order:
                if name in refused:
                    continue
                start, model = made[name]
                try:
                    server = start()
                except Exception as err:  # a peer that cannot serve it: its words, verbatim
                    refused[name] = str(err)[-1500:]
                    continue
                with server:
                    got = measure(server, model)
                for n in SIZES:
                    rows[name][n].append(got[n])
                print(f"round {r + 1} {name}: {got}", flush=True)
    write_report(ns, rows, refused)


def write_report(ns: argparse.Namespace, rows: dict, refused: dict[str, str]) -> None:
    (OUT / "run.json").write_text(json.dumps({"args": vars(ns) | {"llama_cpp": str(
        ns.llama_cpp), "vllm_venv": str(ns.vllm_venv)}, "rows": rows, "refused": refused},
        indent=1))  # fmt: skip
    med = statistics.median
    base = rows["tierserve bf16 dense"]
    lines = [
        "# int4 served: tierserve against llama.cpp and vLLM on this CPU",
        "",
        f"`.venv/bin/python benchmarks/int4_peers.py --rounds {ns.rounds} --hidden {ns.hidden} "
        f"--layers {ns.layers} --vocab {ns.vocab} --llama-cpp DIR` on {cpu_model()}, "
        f"{os.cpu_count()} cores; "
        f"{PROMPT_TOKENS} prompt token ids × {OUTPUT_TOKENS} greedy tokens a request, not "
        "streamed; output tokens/s, medians of alternating rounds (each server started fresh).",
        "",
        "| server | " + " | ".join(
            f"{n} request{'s' * (n > 1)}, tok/s (vs tierserve bf16)" for n in SIZES) + " |",
        "|---|" + "---|" * len(SIZES),
    ]  # fmt: skip
    for name, by_n in rows.items():
        if name in refused or not by_n[SIZES[0]]:
            continue
        cells = []
        for n in SIZES:
            ratio = med([a / b for a, b in zip(by_n[n], base[n], strict=True)])
            cells.append(f"{med(by_n[n]):.1f} ({ratio:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, why in refused.items():
        lines += ["", f"{name} did not serve the checkpoint:", "", "```", why.strip(), "```"]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
