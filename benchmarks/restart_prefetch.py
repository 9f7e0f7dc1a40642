"""The first request after a restart: its prefix fetched from the file store (the default
prefetch policy, auto) against recomputed (best_effort, which admits a lone request at once), in
alternating rounds.

A server computes one prompt per round and stops (SIGTERM: its writes land in the directory).
Each round then restarts a server on that directory under each policy in turn and sends the
same prompt alone, streaming one token; the time to that token and the `cached_tokens` the
server reports are kept. Both restarts of a round read the same stored pages.

    .venv/bin/python benchmarks/restart_prefetch.py [--rounds 3] [--prompt-tokens 900]

Writes benchmarks/results/restart-prefetch/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess, scratch_dir

OUT = Path(__file__).parent / "results" / "restart-prefetch"
POLICIES = ("auto", "best_effort")


def flags(store: Path, policy: str) -> list[str]:
    extra = json.dumps({"path": str(store)})
    return [
        "--max-total-tokens", "8192", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", policy,
    ]  # fmt: skip


def first_token(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the server reported."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start, ttft, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    assert ttft is not None, "no token came back"
    return ttft, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=900)
    ns = parser.parse_args()
    model = default_model() or ""
    root = scratch_dir()
    rng = np.random.default_rng(0)
    rows: list[dict[str, float]] = []
    for r in range(ns.rounds):
        store = root / f"kv-{r}"
        prompt = rng.integers(3, 4000, ns.prompt_tokens).tolist()
        with ServerProcess(model, flags(store, "auto"), root / f"write-{r}.log") as writer:
            first_token(writer.url, prompt)
        row: dict[str, float] = {}
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:  # alternating order
            with ServerProcess(model, flags(store, policy), root / f"{policy}-{r}.log") as s:
                row[f"{policy}_ttft_s"], row[f"{policy}_cached"] = first_token(s.url, prompt)
        rows.append(row)
        print(f"round {r}: {row}", flush=True)
    write_report(ns, rows)


def write_report(ns: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    ratio = statistics.median(row["auto_ttft_s"] / row["best_effort_ttft_s"] for row in rows)
    lines = [
        "# The first request after a restart: fetched or recomputed",
        "",
        f"`.venv/bin/python benchmarks/restart_prefetch.py --rounds {ns.rounds} --prompt-tokens "
        f"{ns.prompt_tokens}` (bundled demo model, 2-core CPU, file backend; each round a "
        "fresh directory written by one server, then a restart under each policy, in "
        "alternating order; one prompt alone, one streamed token)",
        "",
        "| round | auto: TTFT | auto: cached tokens | best_effort: TTFT | best_effort: cached |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {i} | {row['auto_ttft_s'] * 1000:.1f} ms | {row['auto_cached']:.0f} | "
            f"{row['best_effort_ttft_s'] * 1000:.1f} ms | {row['best_effort_cached']:.0f} |"
            for i, row in enumerate(rows)
        ),
        "",
        f"Median TTFT: auto {median('auto_ttft_s') * 1000:.1f} ms (the prefix read from the "
        f"store), best_effort {median('best_effort_ttft_s') * 1000:.1f} ms (recomputed); "
        f"auto / best_effort (median of the rounds' ratios): {ratio:.2f}×.",
        "",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
