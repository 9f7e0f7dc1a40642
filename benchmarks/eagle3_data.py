"""EAGLE-3 training data with `tierserve batch --regenerate`, served by the demo model: the cost
of capturing hidden states, and what turn-by-turn regeneration and prefix ordering do for the
cache.

A synthetic multi-turn dataset (ShareGPT rows: one of three long system prompts, three user
turns) is regenerated through `tierserve serve --hidden-states-dir`:

- plain (the turns opt out of files) against with capture (`--hidden-states-dir`: one
  capture request per row, its file moved to hs_{index}): rows/s, the capture's cost as a
  ratio of times, bytes written per captured token;
- turn by turn (each turn's prompt is the conversation so far, regenerated) against sending
  every turn of every row independently (the dataset's own answers as history, all turns
  shuffled and in flight together): prompt tokens served from the cache;
- with rows sharing a system prompt sent together (the default) against input order (the
  prompts interleaved), on a device pool too small to keep all three prompts: hit rate.

Runs alternate in each round; the report gives medians over the rounds.

    .venv/bin/python benchmarks/eagle3_data.py [--rounds 3]

Writes benchmarks/results/eagle3-data/report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tierserve.args import DEMO_MODEL_DIR
from tierserve.bench.server_process import ServerProcess, scratch_dir

OUT = Path(__file__).parent / "results" / "eagle3-data"
ROWS = 24
MAX_TOKENS = 24
CONCURRENCY = 8
SMALL_POOL = 1536  # tokens: fewer than the rows in flight and three system prompts need
WORDS = [
    "the",
    "a",
    "code",
    "list",
    "sort",
    "function",
    "value",
    "error",
    "test",
    "file",
    "data",
    "loop",
    "map",
    "key",
]


def system_prompt(k: int) -> str:
    rng = random.Random(k)
    return f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(160))


def dataset(path: Path, rows: int = ROWS, turns_per_row: int = 3) -> Path:
    """ShareGPT rows: one of three system prompts, then user turns with a stale answer each
    (benchmarks/speculators_job.py uses it too)."""
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        turns = [{"from": "system", "value": system_prompt(i % 3)}]
        for _ in range(turns_per_row):
            ask = " ".join(rng.choice(WORDS) for _ in range(12))
            turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": "an old answer"}]
        lines.append({"id": f"row-{i}", "conversations": turns})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def regenerate(url: str, src: Path, out: Path, *more: str) -> dict[str, float]:
    """One `batch --regenerate` run: wall seconds, rows/s and its cache hit rate."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out)]
    cmd += ["--url", url, "--regenerate", "--max-tokens", str(MAX_TOKENS), "--no-progress"]
    cmd += ["--concurrency", str(CONCURRENCY), *more]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    hit = re.search(r"hit (\d+)%", done.stderr)
    return {"s": wall, "rows/s": ROWS / wall, "hit": float(hit[1]) / 100 if hit else 0.0}


def independent(url: str, src: Path) -> float:
    """Every assistant turn of every row sent on its own (the dataset's answers as history),
    shuffled, CONCURRENCY in flight: the share of prompt tokens the cache served."""
    jobs = []
    for raw in src.read_text().splitlines():
        turns = json.loads(raw)["conversations"]
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
        jobs += [messages[:k] for k, m in enumerate(messages) if m["role"] == "assistant"]
    random.Random(1).shuffle(jobs)

    async def run() -> float:
        gate, prompt, cached = asyncio.Semaphore(CONCURRENCY), [0], [0]
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def one(messages: list[dict]) -> None:
                async with gate:
                    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
                    body["return_hidden_states"] = False
                    usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
                prompt[0] += usage["prompt_tokens"]
                cached[0] += usage["prompt_tokens_details"]["cached_tokens"]

            await asyncio.gather(*(one(m) for m in jobs))
        return cached[0] / prompt[0]

    return asyncio.run(run())


def flush(url: str) -> None:
    httpx.post(f"{url}/flush_cache", timeout=60)


def captured_bytes_per_token(directory: Path) -> float:
    from safetensors import safe_open

    files = list(directory.glob("hs_*.safetensors"))
    tokens = 0
    for path in files:
        with safe_open(str(path), "pt") as f:
            tokens += f.get_slice("token_ids").get_shape()[0]
    return sum(p.stat().st_size for p in files) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    root = scratch_dir()
    src = dataset(root / "rows.jsonl")
    runs: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    capture = ["--device", "cpu", "--hidden-states-dir", str(root / "server-hs")]
    small = ["--device", "cpu", "--max-total-tokens", str(SMALL_POOL)]
    with (
        ServerProcess(str(DEMO_MODEL_DIR), capture, root / "capture.log") as server,
        ServerProcess(str(DEMO_MODEL_DIR), small, root / "small.log") as tight,
    ):
        for r in range(ns.rounds):
            flush(server.url)
            plain = regenerate(server.url, src, root / "plain.jsonl")
            flush(server.url)
            hs = root / f"hs-{r}"
            with_hs = regenerate(server.url, src, root / "hs.jsonl", "--hidden-states-dir", str(hs))
            flush(server.url)
            keep("plain rows/s", plain["rows/s"])
            keep("capture rows/s", with_hs["rows/s"])
            keep("capture / plain time", with_hs["s"] / plain["s"])
            keep("bytes per captured token", captured_bytes_per_token(hs))
            keep("turn-by-turn hit rate", plain["hit"])
            keep("independent turns hit rate", independent(server.url, src))
            flush(tight.url)
            keep("prefix order hit rate", regenerate(tight.url, src, root / "o.jsonl")["hit"])
            flush(tight.url)
            unordered = regenerate(tight.url, src, root / "u.jsonl", "--no-prefix-order")
            keep("input order hit rate", unordered["hit"])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in runs.items()))
    write_report(ns.rounds, runs)


def write_report(rounds: int, runs: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    lines = [
        "# EAGLE-3 data: capture cost, turn-by-turn regeneration, prefix ordering",
        "",
        f"`.venv/bin/python benchmarks/eagle3_data.py --rounds {rounds}` (demo model, 2-core "
        f"CPU; {ROWS} ShareGPT rows: one of three ~170-word system prompts, three user turns; "
        f"{MAX_TOKENS} tokens per regenerated turn, {CONCURRENCY} rows in flight; `tierserve "
        "batch --regenerate` against `tierserve serve --hidden-states-dir`; prefix ordering on a "
        f"server with `--max-total-tokens {SMALL_POOL}`; medians of the rounds)",
        "",
        "| measure | median | every round |",
        "| --- | ---: | --- |",
        *(f"| {k} | {med[k]:.3g} | {', '.join(f'{x:.3g}' for x in v)} |" for k, v in runs.items()),
        "",
        "Capture costs one more request per row (its whole conversation recomputed: a cached "
        "prefix has no hidden states) and the file's bytes: (layers + 1) × hidden × 4 B per "
        "token in float32, plus the token id.",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
