"""A plain request's latency beside hostile grammar compiles, in one run of alternating rounds.

The reproduction this answers: six requests carrying an enum of 500 strings of 5,000 characters
(a 2.5 MB JSON schema each), whose clients leave after a few seconds, used to leave a plain
8-token request without an answer for more than 60 s: their compiles ran on in the thread pool
that also tokenized plain requests. Each round, against one server (`tierserve serve`, the
demo model), measures a plain 8-token completion's latency

- alone: nothing else in flight;
- compiling: while six such compiles are queued or running (the clients still wait);
- abandoned: right after those six clients left (their compiles ended).

    .venv/bin/python benchmarks/abandoned_grammars.py [--rounds 3]

Writes benchmarks/results/abandoned-grammars/report.md (medians and per-round ratios to alone).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from tierserve.args import default_model
from tierserve.bench.client import parse_prometheus
from tierserve.bench.server_process import ServerProcess, scratch_dir

OUT = Path(__file__).parent / "results" / "abandoned-grammars"
PLAIN = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CASES = ("alone", "compiling", "abandoned")


def hostile(seed: int) -> dict:
    enum = [f"{seed}-{i}-" + "x" * 5_000 for i in range(500)]
    schema = {"type": "object", "properties": {"a": {"enum": enum}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
    return {"prompt": "A", "max_tokens": 4, "response_format": rf}


async def plain(h: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    reply = await h.post("/v1/completions", json=PLAIN)
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - start


async def until(h: httpx.AsyncClient, key: str, value: float) -> None:
    deadline = time.monotonic() + 120
    while parse_prometheus((await h.get("/metrics")).text).get(key) != value:
        assert time.monotonic() < deadline, f"{key} never reached {value}"
        await asyncio.sleep(0.05)


async def one_round(url: str, seed: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as h:
        await plain(h)  # warm
        alone = await plain(h)
        sent = [
            asyncio.ensure_future(h.post("/v1/completions", json=hostile(seed * 10 + i)))
            for i in range(6)
        ]
        await until(h, "tierserve_grammar_compiles_in_flight", 6)
        compiling = await plain(h)
        for task in sent:  # the six clients leave
            task.cancel()
        await asyncio.gather(*sent, return_exceptions=True)
        await until(h, "tierserve_grammar_compiles_in_flight", 0)
        abandoned = await plain(h)
    return {"alone": alone, "compiling": compiling, "abandoned": abandoned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    log = scratch_dir() / "server.log"
    flags = ["--grammar-compile-timeout", "600", "--max-total-tokens", "4096"]
    rounds = []
    with ServerProcess(default_model() or "", flags, log) as server:
        for r in range(ns.rounds):
            rounds.append(asyncio.run(one_round(server.url, r)))
            print(
                f"round {r}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in rounds[-1].items())
            )
        ended = parse_prometheus(httpx.get(f"{server.url}/metrics").text)
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [
        "# A plain request beside abandoned grammar compiles",
        "",
        "`.venv/bin/python benchmarks/abandoned_grammars.py "
        f"--rounds {ns.rounds}` (demo model, 2-core CPU; a plain 8-token completion's latency)",
        "",
        "| case | median latency | median ratio to alone | per round (ms) |",
        "| --- | ---: | ---: | --- |",
    ]
    for case in CASES:
        values = [r[case] for r in rounds]
        ratios = [r[case] / r["alone"] for r in rounds]
        per_round = ", ".join(f"{v * 1000:.0f}" for v in values)
        lines.append(
            f"| {case} | {statistics.median(values) * 1000:.0f} ms | "
            f"{statistics.median(ratios):.2f}× | {per_round} |"
        )
    key = "tierserve_grammar_compiles_ended_total{reason=client_left}"
    lines += ["", f"Compiles ended because their client left: {ended.get(key, 0):.0f}."]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
