"""Where a served run's CPU goes: `LLM.generate` against 64 concurrent streams, and the CPU
seconds of the server's threads and of the client, in one run.

The same 64 prompts of 64–512 token ids × 128 greedy tokens (EOS ignored, demo model) run
offline in this process, then as 64 streamed `/v1/completions` from a client in another
process against `tierserve serve`. Per round it reports output tokens/s of both, and over the
served rounds the CPU seconds of each server thread (from /proc) and of the client process.

    .venv/bin/python benchmarks/served_cpu_split.py [--rounds 3]

Writes benchmarks/results/served-cpu-split/report.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from tierserve import LLM, SamplingParams
from tierserve.args import default_model
from tierserve.bench.compare import ServerProcess

OUT = Path(__file__).parent / "results" / "served-cpu-split"
CLIENT = """
import asyncio, json, sys, httpx
prompts, url = json.loads(sys.stdin.read()), sys.argv[1]
async def one(h, p):
    body = {"prompt": p, "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True}
    async with h.stream("POST", "/v1/completions", json=body) as r:
        return sum([line.startswith("data: {") async for line in r.aiter_lines()])
async def main():
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as h:
        print(sum(await asyncio.gather(*(one(h, p) for p in prompts))))
asyncio.run(main())
"""


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (64,), generator=g).tolist()
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def offline(llm: LLM, batch: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def thread_cpu(pid: int) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def served(url: str, batch: list[list[int]], pid: int) -> tuple[float, dict[int, float], float]:
    """Tokens/s as the client saw them, each server thread's CPU seconds, the client's."""
    import json

    before = thread_cpu(pid)
    start = time.perf_counter()
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    proc = psutil.Process(client.pid)
    client.stdin.write(json.dumps(batch).encode())  # type: ignore[union-attr]
    client.stdin.close()  # type: ignore[union-attr]
    used = 0.0
    while client.poll() is None:
        try:
            times = proc.cpu_times()
            used = times.user + times.system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    wall = time.perf_counter() - start
    tokens = int(client.stdout.read())  # type: ignore[union-attr]
    after = thread_cpu(pid)
    return tokens / wall, {t: after[t] - before.get(t, 0.0) for t in after}, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    batch = prompts()
    llm = LLM(default_model())
    llm.generate(batch[:4], SamplingParams(max_tokens=4))  # warm-up
    log = Path(tempfile.mkdtemp()) / "server.log"
    rows, cpu, client_cpu = [], {}, 0.0
    with ServerProcess(default_model() or "", [], log) as server:
        served(server.url, batch[:8], server.proc.pid)  # warm-up
        for r in range(ns.rounds):  # alternating: offline, then served
            off = offline(llm, batch)
            rate, threads, used = served(server.url, batch, server.proc.pid)
            rows.append((off, rate))
            for t, s in threads.items():
                cpu[t] = cpu.get(t, 0.0) + s
            client_cpu += used
            print(f"round {r}: offline {off:.0f} tok/s, served {rate:.0f} tok/s", flush=True)
    top = sorted(cpu.values(), reverse=True)
    lines = [
        "# Where a served run's CPU goes",
        "",
        f"`.venv/bin/python benchmarks/served_cpu_split.py --rounds {ns.rounds}` (demo model,",
        "2-core CPU; 64 prompts of 64–512 token ids × 128 greedy tokens; the client in its own",
        "process)",
        "",
        "| round | offline tok/s | served tok/s | served / offline |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {i} | {o:.0f} | {s:.0f} | {s / o:.2f}× |" for i, (o, s) in enumerate(rows)),
        "",
        f"Median served / offline: {statistics.median(s / o for o, s in rows):.2f}×.",
        "",
        "CPU seconds over the served rounds, the server's busiest threads first: "
        + ", ".join(f"{s:.1f}" for s in top[:4])
        + f"; the client process: {client_cpu:.1f}.",
        "(`py-spy dump` names them: the engine thread, torch's second thread, the event loop.)",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
