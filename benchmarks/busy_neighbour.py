"""What a CPU-hungry neighbour (a streaming client, a tokenizer) costs the engine's decode step
on a small host, against what a work-conserving split of the cores would cost it.

    .venv/bin/python benchmarks/busy_neighbour.py [--rounds 3] [--duty 0.35] [--burst-us 300]

An offline engine (demo model, float32, the CPU kernels) decodes 64 requests (the prompts of
benchmarks/step_floor.py, prefilled first); each measurement times 24 of its decode steps
(`Engine.step()`, median) with torch's threads at every core, then at one, alone and beside a
neighbour process that spins for `--burst-us` and sleeps so as to use `--duty` of one core,
as an httpx client reading 64 streams did (0.35-0.4 of a core on this machine, in bursts after
each step's chunks). The neighbour's CPU is measured over the timed steps: it gets less than
asked when it waits for a core.

A work-conserving split (the neighbour gets its CPU, the engine every other cycle) would make
the step `threads / min(threads, cores - neighbour's cores)` as long; torch's fork-join
regions split each op's work evenly between their threads up front and wait at the end for
the slowest, so a thread the neighbour takes the core from holds back the other. Rounds
alternate the conditions; figures are medians of the rounds. Writes
benchmarks/results/busy-neighbour/report.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from step_floor import prefilled  # this folder is on the path of a script run from it

from tierserve import LLM
from tierserve.args import default_model

OUT = Path(__file__).parent / "results" / "busy-neighbour"
BATCH, STEPS = 64, 24
# Spins for BURST seconds, then sleeps so that spinning is DUTY of its time.
NEIGHBOUR = """
import sys, time
burst, duty = float(sys.argv[1]), float(sys.argv[2])
print("ready", flush=True)
while True:
    end = time.perf_counter() + burst
    while time.perf_counter() < end:
        pass
    time.sleep(burst * (1 - duty) / duty)
"""


class Neighbour:
    """The spinning process, started before the steps and stopped after (none at duty 0);
    `cores` is the CPU it got meanwhile, in cores."""

    def __init__(self, burst_s: float, duty: float) -> None:
        self.args = [sys.executable, "-c", NEIGHBOUR, str(burst_s), str(duty)]
        self.duty, self.cores = duty, 0.0

    def __enter__(self) -> Neighbour:
        if self.duty:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
            assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
            self.usage = psutil.Process(self.proc.pid)
            self.cpu0, self.wall0 = sum(self.usage.cpu_times()[:2]), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.duty:
            cpu = sum(self.usage.cpu_times()[:2]) - self.cpu0
            self.cores = cpu / (time.perf_counter() - self.wall0)
            self.proc.kill()
            self.proc.wait()


def decode_step_s(llm: LLM, neighbour: Neighbour) -> tuple[float, float]:
    """The median decode step of BATCH requests (seconds), and the neighbour's cores."""
    engine = prefilled(llm, BATCH, STEPS + 2)
    times = []
    with neighbour:
        for _ in range(STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times), neighbour.cores


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duty", type=float, default=0.35, help="the neighbour's share of a core")
    ap.add_argument("--burst-us", type=float, default=300, help="its spins, microseconds")
    ns = ap.parse_args()
    if not 0 < ns.duty < 1:
        raise SystemExit("--duty is a share of one core: between 0 and 1")
    llm = LLM(
        default_model(),
        max_running_requests=BATCH,
        max_total_tokens=65536,
        attention_backend="cpu",
    )
    cores = len(os.sched_getaffinity(0))
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    results: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for r in range(ns.rounds):
        for t in threads if r % 2 == 0 else threads[::-1]:
            torch.set_num_threads(t)
            for busy in (False, True) if r % 2 == 0 else (True, False):
                neighbour = Neighbour(ns.burst_us * 1e-6, ns.duty if busy else 0.0)
                step, used = decode_step_s(llm, neighbour)
                results.setdefault((t, busy), []).append((step, used))
                print(f"round {r}: {_threads(t)}, {'beside' if busy else 'alone'}: "
                      f"{step * 1e3:.2f} ms (neighbour {used:.2f} cores)", flush=True)  # fmt: skip
    llm.close()
    write_report(ns, cores, threads, results)


def write_report(
    ns: argparse.Namespace,
    cores: int,
    threads: list[int],
    results: dict[tuple[int, bool], list[tuple[float, float]]],
) -> None:
    def med(t: int, busy: bool, i: int) -> float:
        return statistics.median(x[i] for x in results[(t, busy)])

    cmd = f"--rounds {ns.rounds} --duty {ns.duty:g} --burst-us {ns.burst_us:g}"
    lines = [
        "# A busy neighbour and the decode step",
        "",
        f"`.venv/bin/python benchmarks/busy_neighbour.py {cmd}` (demo model, float32, CPU "
        f"kernels, offline engine, batch {BATCH}, {cores} cores; medians of {ns.rounds} "
        "alternating rounds). The neighbour spins in bursts of "
        f"{ns.burst_us:g} µs for {ns.duty:g} of a core; 'work-conserving' is the step alone × "
        "threads ÷ min(threads, cores − the neighbour's measured cores).",
        "",
        "| torch threads | step alone | step beside | × | work-conserving × | neighbour's cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in threads:
        alone, beside, used = med(t, False, 0), med(t, True, 0), med(t, True, 1)
        ideal = t / min(t, cores - used)  # t threads on the cores the neighbour leaves
        lines.append(
            f"| {t} | {alone * 1e3:.2f} ms | {beside * 1e3:.2f} ms | {beside / alone:.2f}× "
            f"| {ideal:.2f}× | {used:.2f} |"
        )
    lines += ["", "Every round (step ms alone / beside):", ""]
    lines += ["| round | " + " | ".join(_threads(t) for t in threads) + " |"]
    lines += ["| ---: |" + " ---: |" * len(threads)]
    for r in range(ns.rounds):
        cells = [
            f"{results[(t, False)][r][0] * 1e3:.2f} / {results[(t, True)][r][0] * 1e3:.2f}"
            for t in threads
        ]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
