"""Where a served run's CPU goes: `LLM.generate` against 64 concurrent streams and a multi-turn
load, with the CPU seconds of the API process (per thread), the engine core process and the
client, in one run.

The same 64 prompts of 64–512 token ids × 128 greedy tokens (EOS ignored, demo model) run
offline in this process, then as 64 streamed `/v1/completions` from a client in another
process against `tierserve serve`; the prefix cache is flushed before each. Then the bench's
multi-turn workload (`tierserve bench run --workload multiturn --backend openai
--max-concurrency 8`). Per round it reports output tokens/s; over the rounds, CPU seconds per
1,000 output tokens of each process (and the API process's busiest threads).

    .venv/bin/python benchmarks/served_cpu_split.py [--rounds 3]

Writes benchmarks/results/served-cpu-split/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import torch

from tierserve import LLM, SamplingParams
from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess, scratch_dir
from tierserve.engine import CORE_MODULE

OUT = Path(__file__).parent / "results" / "served-cpu-split"
# aiohttp, as vLLM's and SGLang's serving benchmarks use (httpx's streaming took twice the CPU).
CLIENT = """
import asyncio, json, sys, aiohttp
prompts, url = json.loads(sys.stdin.read()), sys.argv[1] + "/v1/completions"
async def one(h, p):
    body = {"prompt": p, "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True}
    async with h.post(url, json=body) as r:
        return sum([line.startswith(b"data: {") async for line in r.content])
async def main():
    connector = aiohttp.TCPConnector(limit=100)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as h:
        print(sum(await asyncio.gather(*(one(h, p) for p in prompts))))
asyncio.run(main())
"""
PARAMS = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (64,), generator=g).tolist()
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def offline(llm: LLM, batch: list[list[int]]) -> tuple[float, float]:
    """Output tokens/s of `LLM.generate`, and this process's CPU seconds per 1,000 of them."""
    llm.engine.flush_cache()
    me = psutil.Process()
    cpu, start = cpu_of(me), time.perf_counter()
    outs = llm.generate(batch, PARAMS)
    wall, used = time.perf_counter() - start, cpu_of(me) - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / wall, used * 1000 / tokens


def cpu_of(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def threads_of(proc: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in proc.threads()}


class Probe:
    """CPU seconds of the API process (and each of its threads), the core and a client, over
    one measured run."""

    def __init__(self, api: psutil.Process, core: psutil.Process) -> None:
        self.api, self.core = api, core
        self.totals: dict[str, float] = {"api": 0.0, "core": 0.0, "client": 0.0}
        self.threads: dict[int, float] = {}
        self.tokens = 0

    def measure(self, run: Callable[[], tuple[int, float, float | None]]) -> float:
        """`run()` returns (output tokens, its client's CPU seconds, the rate its client
        measured, if it did); that rate (else tokens per wall second) is returned, and the
        CPU the run took is added up here."""
        api0, core0, threads0 = cpu_of(self.api), cpu_of(self.core), threads_of(self.api)
        start = time.perf_counter()
        tokens, client_cpu, rate = run()
        wall = time.perf_counter() - start
        self.totals["api"] += cpu_of(self.api) - api0
        self.totals["core"] += cpu_of(self.core) - core0
        self.totals["client"] += client_cpu
        for t, s in threads_of(self.api).items():
            self.threads[t] = self.threads.get(t, 0.0) + s - threads0.get(t, 0.0)
        self.tokens += tokens
        return rate if rate is not None else tokens / wall

    def per_1k(self) -> dict[str, float]:
        return {k: v * 1000 / self.tokens for k, v in self.totals.items()}


def _client_cpu(client: subprocess.Popen) -> float:
    """The client's CPU seconds, read until it exits."""
    proc, used = psutil.Process(client.pid), 0.0
    while client.poll() is None:
        try:
            used = cpu_of(proc)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    return used


def streams(url: str, batch: list[list[int]]) -> tuple[int, float, None]:
    httpx.post(f"{url}/flush_cache", timeout=60)
    cmd = [sys.executable, "-c", CLIENT, url]
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    client.stdin.write(json.dumps(batch).encode())  # type: ignore[union-attr]
    client.stdin.close()  # type: ignore[union-attr]
    used = _client_cpu(client)
    client.stdout.read()  # type: ignore[union-attr]
    return len(batch) * PARAMS.max_tokens, used, None  # ignore_eos: every token arrives


def multiturn(url: str, out: Path, name: str) -> tuple[int, float, float]:
    cmd = [sys.executable, "-m", "tierserve.cli", "bench", "run", "--url", url, "--name", name]
    cmd += ["--backend", "openai", "--tokenizer", default_model() or "", "--out", str(out)]
    cmd += ["--workload", "multiturn", "--max-concurrency", "8"]
    client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    used = _client_cpu(client)
    summary = json.loads((out / "runs" / f"{name}.json").read_text())["summary"]
    return int(summary["total_output_tokens"]), used, summary["request_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    batch = prompts()
    llm = LLM(default_model(), max_total_tokens=65536)
    llm.generate(batch[:4], SamplingParams(max_tokens=4))  # warm-up
    root = scratch_dir()
    flags = ["--max-total-tokens", "65536"]
    rows: list[tuple[float, float, float]] = []
    offline_cpu: list[float] = []
    with ServerProcess(default_model() or "", flags, root / "server.log") as server:
        api = psutil.Process(server.proc.pid)
        (core,) = [p for p in api.children() if CORE_MODULE in " ".join(p.cmdline())]
        stream_probe, turn_probe = Probe(api, core), Probe(api, core)
        streams(server.url, batch[:8])  # warm-up
        for r in range(ns.rounds):  # alternating: offline, then served
            off, cpu = offline(llm, batch)
            offline_cpu.append(cpu)
            rate = stream_probe.measure(lambda: streams(server.url, batch))
            turns = turn_probe.measure(lambda r=r: multiturn(server.url, root, f"mt-{r}"))
            rows.append((off, rate, turns))
            print(f"round {r}: offline {off:.0f}, streams {rate:.0f}, multi-turn {turns:.1f}")
    write_report(ns.rounds, rows, statistics.median(offline_cpu), stream_probe, turn_probe)


def write_report(
    rounds: int,
    rows: list[tuple[float, float, float]],
    offline_cpu: float,
    stream: Probe,
    turns: Probe,
) -> None:
    def cpu_line(label: str, probe: Probe) -> str:
        per = probe.per_1k()
        busiest = max(probe.threads.values()) * 1000 / probe.tokens
        return (
            f"| {label} | {per['api']:.3f} | {busiest:.3f} | {per['core']:.3f} | "
            f"{per['client']:.3f} |"
        )

    lines = [
        "# Where a served run's CPU goes",
        "",
        f"`.venv/bin/python benchmarks/served_cpu_split.py --rounds {rounds}` (demo model,",
        "2-core CPU; 64 prompts of 64–512 token ids × 128 greedy tokens, prefix cache flushed",
        "before each; multi-turn: the bench's workload over the openai backend, 8 in flight; the",
        "clients in their own processes)",
        "",
        "| round | offline tok/s | 64 streams tok/s | streams / offline | multi-turn req/s |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {i} | {o:.0f} | {s:.0f} | {s / o:.2f}× | {t:.1f} |"
            for i, (o, s, t) in enumerate(rows)
        ),
        "",
        f"Median streams / offline: {statistics.median(s / o for o, s, _ in rows):.2f}×.",
        "",
        "CPU seconds per 1,000 output tokens, over the rounds:",
        "",
        "| load | API process | its busiest thread | engine core | client |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| offline `LLM.generate` (median) | | | {offline_cpu:.3f} | |",
        cpu_line("64 streams", stream),
        cpu_line("multi-turn", turns),
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
