"""How torch's OpenMP threads wait, chosen for two servers on one host and paid for alone.

    .venv/bin/python benchmarks/omp_wait.py [--rounds 3] [--streams 32] [--out-len 64]

libgomp's threads spin at each join before they sleep (GOMP_SPINCOUNT, 300,000 spins unless
OMP_WAIT_POLICY says otherwise). Alone, spinning wakes a thread fastest; beside another busy
process, a spinning thread burns the core the other needs. Each candidate waiting policy is
measured in alternating rounds, the demo model in float32 on every core, servers started with
the policy in their environment (the engine core and its ranks inherit it):

1. alone: one server, `--streams` concurrent streamed completions (random prompts of 64-512
   tokens, `--out-len` greedy tokens each), output tokens/s;
2. two servers: two such servers, each under `--streams` streams at once; their summed tokens/s
   against (1)'s, the line issue 73 sets at 0.8x;
3. the offline batch-64 decode step (an `LLM` in a subprocess, benchmarks/step_floor.py's
   prompts prefilled; the median of 24 steps).

Figures are medians over rounds. Writes benchmarks/results/omp-wait/report.md and run.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from http_streams import stream_one  # this folder is on the path of a script run from it
from offline_throughput import make_prompts

from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess, scratch_dir
from tierserve.distributed.omp_wait import WAIT_VARS

OUT = Path(__file__).parent / "results" / "omp-wait"
# libgomp's own default is 300,000 spins (OMP_WAIT_POLICY unset); PASSIVE is 0.
CANDIDATES: dict[str, dict[str, str]] = {
    "spin (libgomp default)": {"GOMP_SPINCOUNT": "300000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=3000": {"GOMP_SPINCOUNT": "3000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}
STEP = """
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from step_floor import prefilled
from tierserve import LLM
llm = LLM(sys.argv[2], dtype="float32")
engine = prefilled(llm, 64, 40)
times = []
for _ in range(24):
    start = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""


def policy_env(policy: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    return {**env, **policy}


async def streams_tok_s(urls: list[str], prompts: list[list[int]], out_len: int) -> float:
    """Summed output tokens/s of `prompts` streamed to each of `urls` at once."""
    start = time.perf_counter()
    runs = [stream_one(url, p, out_len) for url in urls for p in prompts]
    results = await asyncio.gather(*runs)
    elapsed = time.perf_counter() - start
    assert all(tokens == out_len for _, tokens, _ in results), results
    return len(results) * out_len / elapsed


def served(model: str, policy: dict[str, str], prompts: list[list[int]], out_len: int):
    """(one server alone, two at once) output tokens/s under `policy`."""
    logs = scratch_dir()
    env = policy_env(policy)
    flags = ["--dtype", "float32"]
    with (
        ServerProcess(model, flags, logs / "omp-a.log", env=env) as a,
        ServerProcess(model, flags, logs / "omp-b.log", env=env) as b,
    ):
        for s in (a, b):  # warm-up, then a cold prefix cache for the timed runs
            asyncio.run(stream_one(s.url, prompts[0][:8], 4))
            httpx.post(f"{s.url}/flush_cache").raise_for_status()
        alone = asyncio.run(streams_tok_s([a.url], prompts, out_len))
        for s in (a, b):
            httpx.post(f"{s.url}/flush_cache").raise_for_status()
        both = asyncio.run(streams_tok_s([a.url, b.url], prompts, out_len))
    return alone, both


def offline_step(model: str, policy: dict[str, str]) -> float:
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", STEP, here, model],
        env=policy_env(policy), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def cpu_model() -> str:
    """The model name, and what tells one EPYC generation from another where the name alone
    does not (a VM's "AMD EPYC"): family, model, AVX-512."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    avx512 = "AVX-512" if "avx512f" in info.get("flags", "").split() else "no AVX-512"
    name = info.get("model name") or platform.processor()
    return f"{name} (family {info.get('cpu family')}, model {info.get('model')}, {avx512})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    ns = ap.parse_args()
    names = ns.only or list(CANDIDATES)
    prompts = make_prompts(ns.streams, 4096, seed=0)
    rows = {n: {"alone": [], "both": [], "step": []} for n in names}
    for r in range(ns.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            alone, both = served(ns.model, CANDIDATES[name], prompts, ns.out_len)
            step = offline_step(ns.model, CANDIDATES[name])
            row = rows[name]
            row["alone"].append(alone)
            row["both"].append(both)
            row["step"].append(step)
            print(
                f"round {r + 1} {name}: alone {alone:.0f} tok/s, two servers {both:.0f} "
                f"({both / alone:.2f}x), batch-64 step {step * 1e3:.1f} ms",
                flush=True,
            )
    write_report(ns, rows)


def write_report(ns: argparse.Namespace, rows: dict[str, dict[str, list[float]]]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "run.json").write_text(json.dumps({"args": vars(ns), "rows": rows}, indent=1))
    base = rows.get("spin (libgomp default)")
    med = statistics.median
    lines = [
        "# OpenMP waiting: two servers on one host, and the cost alone",
        "",
        f"`.venv/bin/python benchmarks/omp_wait.py --rounds {ns.rounds} --streams {ns.streams} "
        f"--out-len {ns.out_len}` on {cpu_model()}, {os.cpu_count()} cores, demo model in "
        "float32; medians of alternating rounds (per-round figures in run.json).",
        "",
        "| policy | one server alone, tok/s | two servers at once, tok/s | two / one | "
        "alone vs spin | batch-64 step, ms | step vs spin |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        alone, both, step = med(row["alone"]), med(row["both"]), med(row["step"])
        ratio = med([b / a for a, b in zip(row["alone"], row["both"], strict=True)])
        vs = f"{alone / med(base['alone']):.2f}x" if base else "-"
        step_vs = f"{step / med(base['step']):.2f}x" if base else "-"
        lines.append(
            f"| {name} | {alone:.0f} | {both:.0f} | {ratio:.2f}x | {vs} | {step * 1e3:.1f} | "
            f"{step_vs} |"
        )
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
