"""`tierserve serve` from launch to its first /health 200: wall time, and the CPU-seconds each of
its processes spent getting there; then its first structured output's wait.

    .venv/bin/python benchmarks/server_start.py [--rounds 5] [--against DIR] [--tp-size N]

Each round starts the demo model's server on a free port, polls /health every 50 ms, reads each
process's CPU time (user + system) at the first 200, records whether the API process has torch
mapped, then times one completion with a JSON schema (the server's first grammar compile: a
compile worker's start, and xgrammar in the engine core) and reads the API process's unique
memory (USS) after it, and stops it. `--against DIR` alternates with another checkout of
tierserve (imported from DIR through PYTHONPATH, with this venv), the other first in even
rounds; each ratio is the median of the rounds' ratios. `--tp-size N` serves N rank processes
(the engine core's CPU-seconds then include its ranks'). Writes
benchmarks/results/server-start/report.md (report-tpN.md with --tp-size N).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from served_cpu_split import cpu_of  # beside this script: on sys.path

from tierserve.bench.report import machine_info
from tierserve.engine import CORE_MODULE
from tierserve.utils import free_port

OUT = Path(__file__).parent / "results" / "server-start"
START_TIMEOUT_S = 300  # a start that takes longer is a hang, reported with the server's log
HERE = str(Path(__file__).resolve().parents[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return reply.status == 200
    except (OSError, http.client.HTTPException):  # not listening yet, or a reply cut short
        return False


# The first structured output: 8 tokens under a small JSON schema.
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
STRUCTURED = {
    "prompt": "A",
    "max_tokens": 8,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
}


def structured_s(url: str) -> float:
    """Seconds one structured completion takes."""
    body = json.dumps(STRUCTURED).encode()
    ask = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(ask, timeout=START_TIMEOUT_S) as reply:
        reply.read()
    return time.perf_counter() - start


def has_torch(proc: psutil.Process) -> bool:
    return any("libtorch" in Path(m.path).name for m in proc.memory_maps())


def start_once(tree: str, tp_size: int) -> dict:
    """One server from `tree`, timed to its first /health 200."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port)]
    cmd += ["--tp-size", str(tp_size)] if tp_size > 1 else []
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=tree)
        try:
            url = f"http://127.0.0.1:{port}"
            while not healthy(url):
                if proc.poll() is not None or time.perf_counter() - start > START_TIMEOUT_S:
                    log.seek(0)
                    what = "exited" if proc.poll() is not None else "did not start"
                    sys.exit(f"the server from {tree} {what}: {log.read().decode()[-2000:]}")
                time.sleep(0.05)
            up = time.perf_counter() - start
            api = psutil.Process(proc.pid)
            (core,) = [c for c in api.children() if CORE_MODULE in c.cmdline()]
            ranks = sum(cpu_of(rank) for rank in core.children())
            got = {"up_s": up, "api_cpu_s": cpu_of(api), "core_cpu_s": cpu_of(core) + ranks,
                   "api_torch": has_torch(api)}  # fmt: skip
            got["structured_s"] = structured_s(url)
            got["api_uss_mib"] = api.memory_full_info().uss / 2**20
            got["api_torch_after"] = has_torch(api)
            return got
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # its core dies with it (parent-death signal)
                proc.kill()
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", help="another checkout of tierserve, alternated with this one")
    ap.add_argument("--tp-size", type=int, default=1, help="serve with this many ranks")
    ns = ap.parse_args()
    trees = {"this tree": HERE}
    if ns.against:
        trees["against"] = str(Path(ns.against).resolve())
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(ns.rounds):
        for name in list(trees) if r % 2 else list(trees)[::-1]:
            runs[name].append(start_once(trees[name], ns.tp_size))
        print(json.dumps({name: rs[-1] for name, rs in runs.items()}), flush=True)
    write_report(ns, trees, runs)


def write_report(ns: argparse.Namespace, trees: dict[str, str], runs: dict[str, list]) -> None:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    against = f" --against {ns.against}" if ns.against else ""
    against += f" --tp-size {ns.tp_size}" if ns.tp_size > 1 else ""
    machine = {"cpu_model": "an unnamed CPU", **machine_info()}
    lines = [
        "# `tierserve serve` from launch to /health 200",
        "",
        f"`.venv/bin/python benchmarks/server_start.py --rounds {ns.rounds}{against}` "
        f"(demo model, its defaults; {machine['cpu_model']}, {machine['cpus_usable']} cores).",
        "",
        "| tree | to /health 200, s | API process, CPU-s | engine core and its ranks, CPU-s | "
        "API process has torch | first structured output, s | then: API process USS, MiB, "
        "has torch |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for name, tree in trees.items():
        head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        tree = f"{tree} at {head}" if head else tree

        def seen(key: str, name: str = name) -> str:
            return ", ".join(map(str, sorted({run[key] for run in runs[name]})))

        lines.append(
            f"| {name} ({tree}) | {median(name, 'up_s'):.2f} | {median(name, 'api_cpu_s'):.2f} | "
            f"{median(name, 'core_cpu_s'):.2f} | {seen('api_torch')} | "
            f"{median(name, 'structured_s'):.2f} | {median(name, 'api_uss_mib'):.0f}, "
            f"{seen('api_torch_after')} |"
        )
    if ns.against:
        for key, what in (("up_s", "Start-up"), ("structured_s", "First structured output")):
            ratios = [a[key] / t[key] for t, a in zip(*runs.values(), strict=True)]
            lines += ["", f"{what}, against / this tree: {statistics.median(ratios):.2f}× "
                      f"(median of {ns.rounds} alternated rounds: "
                      f"{', '.join(f'{x:.2f}' for x in ratios)})."]  # fmt: skip
    lines += ["", "Medians of the rounds. Each round's figures:", "", "```"]
    lines += [json.dumps({name: rs[i] for name, rs in runs.items()}) for i in range(ns.rounds)]
    lines += ["```", ""]
    OUT.mkdir(parents=True, exist_ok=True)
    name = "report.md" if ns.tp_size == 1 else f"report-tp{ns.tp_size}.md"
    (OUT / name).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
