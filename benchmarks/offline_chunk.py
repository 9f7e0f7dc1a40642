"""The offline batch of benchmarks/vllm_peer.py (64 prompts of 64-512 token ids × 128 greedy
tokens, after a warm-up batch, timed around `generate`) at several `chunked_prefill_size`
values, each in a fresh process, the values in alternating order each round.

    .venv/bin/python benchmarks/offline_chunk.py [--rounds 6] [--sizes 2048,4096,8192]

Writes benchmarks/results/offline-chunk/report.md: tok/s per size (median of the rounds) and
each against the first size, with every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vllm_peer import NUM_PROMPTS, OUTPUT_TOKENS, TIERSERVE_OFFLINE, _json_of

from tierserve.args import default_model

OUT = Path(__file__).parent / "results" / "offline-chunk"


def tok_s(model: str, size: int) -> float:
    kwargs = json.dumps({"chunked_prefill_size": size})
    out = _json_of([sys.executable, "-c", TIERSERVE_OFFLINE, model, "full", "0", kwargs])
    return NUM_PROMPTS * OUTPUT_TOKENS / out["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sizes", default="2048,4096,8192", help="comma-separated token budgets")
    ns = ap.parse_args()
    sizes = [int(x) for x in ns.sizes.split(",")]
    model = default_model()
    runs: dict[int, list[float]] = {s: [] for s in sizes}
    for r in range(ns.rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            runs[size].append(tok_s(model, size))
            print(f"round {r}: {size} tokens: {runs[size][-1]:,.0f} tok/s", flush=True)
    write_report(ns, sizes, runs)


def write_report(ns: argparse.Namespace, sizes: list[int], runs: dict[int, list[float]]) -> None:
    base = sizes[0]
    lines = [
        "# The offline batch against the prefill budget",
        "",
        f"`.venv/bin/python benchmarks/offline_chunk.py --rounds {ns.rounds} --sizes {ns.sizes}` "
        f"(demo model, float32, {NUM_PROMPTS} prompts × {OUTPUT_TOKENS} greedy tokens, "
        "vllm_peer.py's offline batch; a fresh process per run; medians of the rounds, the "
        f"sizes in alternating order). × is each round's ratio to {base} tokens, its median.",
        "",
        "| chunked_prefill_size | tok/s | × |",
        "| ---: | ---: | ---: |",
    ]
    for size in sizes:
        ratio = statistics.median(a / b for a, b in zip(runs[size], runs[base], strict=True))
        lines.append(f"| {size} | {statistics.median(runs[size]):,.0f} | {ratio:.3f}× |")
    lines += ["", "Every round (tok/s):", "", "| round | " + " | ".join(map(str, sizes)) + " |"]
    lines += ["| ---: |" + " ---: |" * len(sizes)]
    for r in range(ns.rounds):
        lines.append(f"| {r} | " + " | ".join(f"{runs[s][r]:,.0f}" for s in sizes) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
