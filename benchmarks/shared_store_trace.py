"""Mooncake trace replay across two servers that share one Mooncake Store, beside one server
whose device pool holds the whole trace (the hit-rate ceiling) and two servers that share
nothing.

The trace's requests alternate between the two servers (request i goes to server i mod 2), so a
conversation's next turn usually lands on the server that did not compute its prefix: only the
shared store can turn it into a hit. Each two-server configuration has a small device pool and a
host tier; the store is a real `mooncake_master` on loopback. Hit rate is Σ cached ÷ Σ prompt
tokens over every request (all tiers), as the servers report them in `usage`.

    .venv/bin/python benchmarks/shared_store_trace.py [--num-requests 160] [--out DIR]

Writes DIR/report.md, DIR/results.json and DIR/hit_rate.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from tierserve.args import default_model
from tierserve.bench.client import LoadOptions, RunResult, run_load_async
from tierserve.bench.metrics import hit_rate, summarize
from tierserve.bench.server_process import ServerProcess
from tierserve.bench.workloads import TokenSpace, Workload, trace
from tierserve.model_config import ModelConfig
from tierserve.storage.mooncake import MooncakeMaster

OUT = Path(__file__).parent / "results" / "shared-store-trace"


def split(workload: Workload, parts: int) -> list[Workload]:
    """Request i to part i mod `parts`, arrival times kept."""
    return [replace(workload, requests=workload.requests[k::parts]) for k in range(parts)]


async def replay(urls: list[str], workload: Workload, opts: LoadOptions) -> list[RunResult]:
    """Each server its share of the trace, all at once, on the trace's clock."""
    parts = split(workload, len(urls))
    runs = (run_load_async(u, w, opts) for u, w in zip(urls, parts, strict=True))
    return list(await asyncio.gather(*runs))


def measure(name: str, results: list[RunResult]) -> dict[str, Any]:
    records = [r for res in results for r in res.records]
    summaries = [summarize(res) for res in results]
    return {
        "name": name,
        "hit_rate": hit_rate(records),
        "requests": len(records),
        "failed": sum(not r.ok for r in records),
        "duration_s": max(res.duration for res in results),
        "ttft_mean_s": sum(s["ttft_s"]["mean"] * s["completed"] for s in summaries)
        / max(1, sum(s["completed"] for s in summaries)),
        "storage_hit_pages": sum(
            (res.server_metrics_after or {}).get("tierserve_storage_hit_pages_total", 0)
            for res in results
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled demo model")
    p.add_argument("--trace", default="conversation")
    p.add_argument("--num-requests", type=int, default=160)
    p.add_argument("--block-scale", type=Fraction, default=Fraction(1, 32))
    p.add_argument("--length-scale", type=Fraction, default=Fraction(1, 32))
    p.add_argument("--time-scale", type=float, default=0.02, help="arrival times × this")
    p.add_argument("--device-tokens", type=int, default=2048, help="two-server device pools")
    p.add_argument("--policy", default="timeout", help="--hicache-storage-prefetch-policy")
    p.add_argument(
        "--prefetch-threshold",
        type=int,
        default=16,
        help="tokens; the default 256 is scaled with the trace's lengths (256 / 32 -> a page)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    ns = p.parse_args()
    model = ns.model or default_model()
    cfg = ModelConfig.from_dir(model)
    workload = trace(
        TokenSpace(cfg.vocab_size, 16),
        path=ns.trace,
        num_requests=ns.num_requests,
        block_scale=float(ns.block_scale),
        length_scale=float(ns.length_scale),
        time_scale=ns.time_scale,
        context_length=cfg.max_position_embeddings,
    )
    opts = LoadOptions(backend="generate", max_in_flight=0, flush_before=True)
    logs = ns.out / "logs"
    page = ["--page-size", "16"]
    small = ["--max-total-tokens", str(ns.device_tokens), *page, "--enable-hierarchical-cache"]
    ceiling = 2 * workload.kv_tokens() + 16 * workload.num_requests
    runs = []

    print(f"trace {ns.trace}: {workload.num_requests} requests, {workload.params}", flush=True)
    with ServerProcess(model, ["--max-total-tokens", str(ceiling), *page], logs / "one.log") as s:
        runs.append(measure("one server, device pool holds everything", asyncio.run(
            replay([s.url], workload, opts))))  # fmt: skip
    print(runs[-1], flush=True)

    with (
        ServerProcess(model, small, logs / "a.log") as a,
        ServerProcess(model, small, logs / "b.log") as b,
    ):
        runs.append(measure("two servers, no shared store", asyncio.run(
            replay([a.url, b.url], workload, opts))))  # fmt: skip
    print(runs[-1], flush=True)

    master = MooncakeMaster()
    try:
        store = ["--hicache-storage-backend", "mooncake", "--hicache-storage-prefetch-policy",
                 ns.policy, "--hicache-storage-backend-extra-config",
                 json.dumps(master.extra(global_segment_size=512 * 2**20,
                                         prefetch_threshold=ns.prefetch_threshold))]  # fmt: skip
        with (
            ServerProcess(model, small + store, logs / "a-store.log") as a,
            ServerProcess(model, small + store, logs / "b-store.log") as b,
        ):
            runs.append(measure("two servers, one Mooncake Store", asyncio.run(
                replay([a.url, b.url], workload, opts))))  # fmt: skip
    finally:
        master.stop()
    print(runs[-1], flush=True)
    write(ns, workload, runs, ceiling)


def write(ns: argparse.Namespace, workload: Workload, runs: list[dict], ceiling: int) -> None:
    ns.out.mkdir(parents=True, exist_ok=True)
    best = runs[0]["hit_rate"] or 0.0
    for r in runs:
        r["hit_rate_vs_ceiling"] = (r["hit_rate"] or 0.0) / best if best else None
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "workload": workload.params,
        "ceiling_device_tokens": ceiling,
        "two_server_device_tokens": ns.device_tokens,
        "prefetch_policy": ns.policy,
        "prefetch_threshold": ns.prefetch_threshold,
    }
    (ns.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    rows = "\n".join(
        f"| {r['name']} | {r['hit_rate']:.1%} | {r['hit_rate_vs_ceiling']:.2f}× | "
        f"{r['requests']} ({r['failed']} failed) | {r['ttft_mean_s']:.3f} s | "
        f"{int(r['storage_hit_pages'])} |"
        for r in runs
    )
    params = workload.params
    (ns.out / "report.md").write_text(
        f"# Trace replay across two servers sharing one store\n\n`{meta['command']}`\n\n"
        f"Trace `{params['trace_file'].split('/')[-1]}`, first {params['num_requests']} "
        f"requests; block scale {params['block_scale']:.4g} ({params['block_tokens']} tokens "
        f"per hash id), length scale {params['length_scale']:.4g}, time scale "
        f"{params['time_scale']:g}; context {params['context_length']} tokens: "
        f"{params['clipped']} prompts clipped, {params['skipped']} requests skipped. Two-server "
        f"device pools {ns.device_tokens} tokens each, host tier 2× that; store: prefetch "
        f"policy {ns.policy}, threshold {ns.prefetch_threshold} tokens.\n\n"
        "| configuration | hit rate (all tiers) | ÷ ceiling | requests | TTFT mean | "
        "storage hit pages |\n| --- | ---: | ---: | ---: | ---: | ---: |\n"
        f"{rows}\n"
    )
    plot(runs, ns.out / "hit_rate.png")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["name"] for r in runs]
    ax.barh(names, [100 * (r["hit_rate"] or 0) for r in runs], color=["#888", "#c66", "#4a8"])
    ax.set_xlabel("prompt tokens served from cache (%)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
