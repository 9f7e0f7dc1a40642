"""Where a served engine's threads run: tierserve's CPU placements side by side, in alternating
rounds on this machine, with both of the vLLM peer benchmark's stream clients.

    .venv/bin/python benchmarks/cpu_placement.py [--rounds 3]

Placements (distributed/placement.py):
- `auto` (the default): the engine core's torch threads on the cores the server inherited,
  one a core; a core is kept for the API process only when the ranks keep two each;
- `reserve`: `--cpu-reserved-cores 1`, vLLM's CPU layout on a 2-core machine (its engine core's
  threads on core 0, core 1 for the API server: `reserve_cpu_num=1` in its log);
- `nobind`: the off switch, torch's threads as they come.

Each round starts one server per placement, in turn, a different one first each round (this
machine's speed drifts within minutes); on it, each client in its own process
runs a warm-up batch of 64 streams, then its own 64 measured prompts (64–512 token ids × 128
greedy tokens; none in the prefix cache). Writes benchmarks/results/cpu-placement/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vllm_peer import CLIENT_SEEDS, NAME, streams_tok_s  # beside this script: on sys.path

from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess

OUT = Path(__file__).parent / "results" / "cpu-placement"
PLACEMENTS = {
    "auto": [],
    "reserve": ["--cpu-reserved-cores", "1"],
    "nobind": ["--cpu-omp-threads-bind", "nobind"],
}
CLIENTS = ("aiohttp", "httpx")


def one_server(model: str, placement: str) -> dict[str, float]:
    flags = ["--served-model-name", NAME, "--max-total-tokens", "65536"]
    log = OUT / "logs" / f"{placement}.log"
    server = ServerProcess(model, flags + PLACEMENTS[placement], log, startup_timeout_s=600)
    try:
        return {c: streams_tok_s(server, c, "full", CLIENT_SEEDS[c]) for c in CLIENTS}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    model = default_model()
    rows: list[dict[str, float]] = []
    for r in range(ns.rounds):
        row = {}
        names = list(PLACEMENTS)
        for placement in names[r % len(names) :] + names[: r % len(names)]:  # each leads once
            got = one_server(model, placement)
            row |= {f"{placement}_{client}_tok_s": tok_s for client, tok_s in got.items()}
        row = {f"{p}_{c}_tok_s": row[f"{p}_{c}_tok_s"] for p in names for c in CLIENTS}
        rows.append(row)
        print(json.dumps({"round": r, **row}), flush=True)
    write_report(rows, ns.rounds)


def write_report(rows: list[dict[str, float]], rounds: int) -> None:
    def ratio(placement: str, client: str) -> float:
        key = f"_{client}_tok_s"
        return statistics.median(row[placement + key] / row["auto" + key] for row in rows)

    lines = [
        "# Served streams under each CPU placement",
        "",
        f"`.venv/bin/python benchmarks/cpu_placement.py --rounds {rounds}` (demo model, float32, "
        "2-core CPU; one server at a time, each placement in turn every round, another first each "
        "round; each client in "
        "its own process, 64 streams × 128 tokens after a warm-up batch). Medians of the "
        f"{rounds} rounds; ratios are medians of the rounds' ratios to `auto`.",
        "",
        "| placement | " + " | ".join(f"{c} tok/s | {c} / auto" for c in CLIENTS) + " |",
        "| --- | " + " | ".join("---: | ---:" for _ in CLIENTS) + " |",
    ]
    for placement, flags in PLACEMENTS.items():
        cells = []
        for client in CLIENTS:
            med = statistics.median(row[f"{placement}_{client}_tok_s"] for row in rows)
            cells.append(f"{med:,.0f} | {ratio(placement, client):.2f}×")
        name = f"`{placement}`" + (f" (`{' '.join(flags)}`)" if flags else " (default)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Every round:", "", "| round | " + " | ".join(rows[0]) + " |"]
    lines.append("| --- | " + " | ".join("---:" for _ in rows[0]) + " |")
    for i, row in enumerate(rows):
        lines.append(f"| {i} | " + " | ".join(f"{v:,.0f}" for v in row.values()) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print((OUT / "report.md").read_text())


if __name__ == "__main__":
    main()
