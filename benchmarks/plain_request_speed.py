"""A plain request's speed before and after the OpenAI-API features (issue 16), in one run.

Penalties, logprobs, n, echo and structured output all touch the per-token path (sampler, step
outputs, output builder, response chunks); a request that asks for none of them must not pay.
This runs the same workloads on the code of `--before` (default: the commit before issue 16's
first change) and of the working tree, in alternating rounds so drift hits both alike:

- engine: `LLM.generate`, 16 prompts of 64–512 token ids × 128 greedy tokens (tok/s);
- decode: one request, 16-token prompt × 256 greedy tokens, alone (tok/s);
- stream: the same single request as a streamed /v1/completions through a real server, as the
  client sees it from its first token to its last (tok/s).

    .venv/bin/python benchmarks/plain_request_speed.py [--before REV] [--rounds 5]

Each round runs each tree in a fresh process; the report gives per-round after/before ratios
and their median. The old tree is exported with `git archive` into a temporary directory and
imported first on PYTHONPATH, with this checkout's virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "abdd91e"  # parent of f365b2e, issue 16's first commit (penalties)
WORKLOADS = ("engine", "decode", "stream")


# --- the worker: runs inside one tree ---------------------------------------------------------


def worker() -> dict[str, float]:
    import httpx
    import torch

    import tierserve
    from tierserve import LLM, SamplingParams
    from tierserve.args import default_model
    from tierserve.bench.server_process import ServerProcess

    model = default_model()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (16,), generator=g).tolist()
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
    short = torch.randint(3, 4000, (16,), generator=g).tolist()
    out: dict[str, float] = {"tree": str(Path(tierserve.__file__).parents[1])}  # type: ignore[dict-item]

    llm = LLM(model)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.engine.flush_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    out["engine"] = 16 * 128 / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(short, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    out["decode"] = 256 / (time.perf_counter() - start)
    del llm

    # The tree under test imports ServerProcess (it may predate scratch_dir).
    logs = tempfile.TemporaryDirectory(prefix="tierserve-bench-")
    server = ServerProcess(model, [], Path(logs.name) / "server.log")
    try:
        body = {"prompt": short, "max_tokens": 256, "temperature": 0, "ignore_eos": True}
        body["stream"] = True
        times = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
        out["stream"] = (len(times) - 1) / (times[-1] - times[0])
    finally:
        server.stop()
        logs.cleanup()
    return out


# --- the driver -------------------------------------------------------------------------------


def export(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_tree(tree: Path) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["tree"]).resolve() == tree.resolve(), result["tree"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export(args.before, Path(tmp) / "before"), "after": ROOT}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                runs[name].append(run_tree(trees[name]))
            row = "  ".join(
                f"{w} {runs['after'][-1][w] / runs['before'][-1][w]:.3f}×" for w in WORKLOADS
            )
            print(f"round {r + 1}: after/before  {row}", flush=True)
    print(f"\nbefore = {args.before}, after = working tree; {args.rounds} rounds, tok/s")
    print(f"{'workload':10} {'before':>9} {'after':>9} {'median ratio':>13} {'range':>15}")
    for w in WORKLOADS:
        before = [x[w] for x in runs["before"]]
        after = [x[w] for x in runs["after"]]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        print(
            f"{w:10} {statistics.median(before):9.1f} {statistics.median(after):9.1f}"
            f" {statistics.median(ratios):12.3f}× {min(ratios):6.3f}–{max(ratios):.3f}×"
        )
    if args.json:
        args.json.write_text(json.dumps({"before_rev": args.before, **runs}, indent=1))


if __name__ == "__main__":
    main()
