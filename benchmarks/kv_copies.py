"""Tier copies and KV memory, side by side in one run.

1. memcpy: this machine's plain copy bandwidth (`Tensor.copy_`), on a large buffer and on a
   buffer the size of an average load-back batch.
2. load-back: bytes/s of the host → device copies in a multi-turn run with the hierarchical
   cache (the workload of benchmarks/hicache_multiturn.py), from the engine's own statistics
   (copy time only, as the copy path measures it).
3. decode-heavy memory: peak RSS of a process that fills the device pool with decoding
   requests, beside the start-up plan's bytes (weights + device pool + decode workspace bound).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kv_copies.py [--out benchmarks/results/kv-copies]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tierserve.args import EngineArgs, default_model
from tierserve.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).parent))
import hicache_multiturn


def memcpy_gbps(nbytes: int, repeats: int = 20, threads: int | None = None) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    return nbytes / statistics.median(times) / 1e9


def load_back(model: str, clients: int, rounds: int) -> dict:
    ns = argparse.Namespace(
        clients=clients,
        rounds=rounds,
        max_in_flight=8,
        first_len=600,
        question_len=32,
        output_len=8,
        seed=0,
    )
    total = clients * (ns.first_len + rounds * (ns.question_len + ns.output_len))
    args = EngineArgs(
        model=model,
        max_total_tokens=total // 4,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
    )
    engine = Engine(args)
    vocab = Engine.vocab_size_of(model)
    hicache_multiturn.warm_up(engine, vocab)
    hicache_multiturn.run_once("hicache", engine, ns, vocab)
    s = engine.kv.host.stats
    return {
        "load_backs": s.load_backs,
        "load_batches": s.load_batches,
        "bytes": s.load_back_bytes,
        "seconds": s.load_back_seconds,
        "gbps": s.load_back_bytes / s.load_back_seconds / 1e9,
        "backup_gbps": s.backup_bytes / max(s.backup_seconds, 1e-9) / 1e9,
        "mean_batch_bytes": s.load_back_bytes // max(1, s.load_batches),
        "page_bytes": engine.kv_plan.spec.bytes_per_page,
    }


def decode_heavy_child(model: str, requests: int, prompt: int, output: int) -> None:
    """Runs in its own process so its peak RSS is its own."""
    import psutil

    from tierserve import SamplingParams

    proc = psutil.Process()
    base = proc.memory_info().rss
    import_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = Engine(EngineArgs(model=model, max_total_tokens=requests * (prompt + output)))
    started = proc.memory_info().rss
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request(torch.randint(3, vocab, (prompt,), generator=g).tolist(), params)
    workspace_peak = sampled_peak = 0
    while engine.has_unfinished():
        engine.step()
        ws = engine.runner.attn.workspace
        workspace_peak = max(workspace_peak, ws.tokens)
        sampled_peak = max(sampled_peak, proc.memory_info().rss)
    plan = engine.kv_plan
    spec = plan.spec
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    # The kernel's peak counts when the run set it; otherwise it is the imports' peak.
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = max(sampled_peak, max_rss if max_rss > import_peak else 0)
    print(
        json.dumps(
            {
                "rss_before_engine": base,
                "rss_after_start": started,
                "rss_peak": peak,
                "rss_growth": peak - base,
                "plan_weights": weights,
                "plan_device_pool": plan.device_bytes,
                "plan_workspace_bound": plan.workspace_bytes,
                "plan_total": weights + plan.device_bytes + plan.workspace_bytes,
                "workspace_peak_bytes": workspace_peak * spec.bytes_per_token,
                "rss_sampled_peak": sampled_peak,
            }
        )
    )


def decode_heavy(model: str, requests: int, prompt: int, output: int) -> dict:
    cmd = [sys.executable, __file__, "--child", model, str(requests), str(prompt), str(output)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(mem: dict[str, float], lb: dict, rss: dict, ns: argparse.Namespace) -> str:
    gb = 1e9
    ratio_big = lb["gbps"] / mem["large"]
    ratio_one = lb["gbps"] / mem["large_1t"]
    ratio_batch = lb["gbps"] / mem["batch"]
    spread = ", ".join(f"{x:.2f}" for x in lb["gbps_runs"])
    return "\n".join(
        [
            "# Tier copies and KV memory (CPU)",
            "",
            f"`OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python "
            f"benchmarks/kv_copies.py`; torch {torch.__version__}, demo model, one run.",
            "",
            "## Load-back bandwidth vs memcpy",
            "",
            "| copy | GB/s | load-back ÷ this |",
            "| --- | ---: | ---: |",
            f"| memcpy, {mem['large_bytes'] / gb:.2f} GB buffer, "
            f"{torch.get_num_threads()} threads | {mem['large']:.2f} | {ratio_big:.2f}× |",
            f"| memcpy, {mem['large_bytes'] / gb:.2f} GB buffer, 1 thread | "
            f"{mem['large_1t']:.2f} | {ratio_one:.2f}× |",
            f"| memcpy, {mem['batch_bytes'] / 1e6:.1f} MB (mean load-back batch) | "
            f"{mem['batch']:.2f} | {ratio_batch:.2f}× |",
            f"| load-back, host → device ({lb['load_batches']} batches, "
            f"{lb['bytes'] / gb:.3f} GB; median of runs: {spread}) | {lb['gbps']:.2f} | 1.00× |",
            f"| backup, device → host | {lb['backup_gbps']:.2f} | |",
            "",
            f"Multi-turn: {ns.clients} clients × {ns.rounds} rounds, 8 in flight, first turn 600 "
            "tokens; device pool a quarter of the conversations, host tier 8× the pool. The "
            "ratio column is load-back ÷ memcpy (target ≥ 0.5 of the machine's memcpy). A "
            f"{lb['page_bytes'] // 1024} KiB page is one block; a load-back copies runs of "
            "consecutive pages, one `copy_` each, on one core. Backups write host pages for the "
            "first time (the host tier is committed as it fills), hence their lower rate.",
            "",
            "## Decode-heavy memory vs the start-up plan",
            "",
            f"{ns.requests} requests × ({ns.prompt} prompt + {ns.output} output) tokens, all "
            "decoding together in a device pool that holds exactly them.",
            "",
            "| | bytes |",
            "| --- | ---: |",
            f"| plan: weights | {rss['plan_weights'] / gb:.3f} GB |",
            f"| plan: device pool | {rss['plan_device_pool'] / gb:.3f} GB |",
            f"| plan: decode workspace bound (2× pool) | "
            f"{rss['plan_workspace_bound'] / gb:.3f} GB |",
            f"| plan: total | {rss['plan_total'] / gb:.3f} GB |",
            f"| decode workspace at its peak | {rss['workspace_peak_bytes'] / gb:.3f} GB |",
            f"| RSS after imports, before the engine | {rss['rss_before_engine'] / gb:.3f} GB |",
            f"| RSS growth at start-up (weights, pool, tokenizer, modules) | "
            f"{(rss['rss_after_start'] - rss['rss_before_engine']) / gb:.3f} GB |",
            f"| RSS growth while decoding (workspace, activations) | "
            f"{(rss['rss_peak'] - rss['rss_after_start']) / gb:.3f} GB |",
            f"| peak RSS growth (engine + run) | {rss['rss_growth'] / gb:.3f} GB |",
            f"| peak RSS growth ÷ plan total | {rss['rss_growth'] / rss['plan_total']:.2f}× |",
            "",
        ]
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        decode_heavy_child(sys.argv[2], *(int(a) for a in sys.argv[3:6]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3, help="multi-turn runs; the median")
    p.add_argument("--out", default="benchmarks/results/kv-copies")
    ns = p.parse_args()
    model = ns.model or default_model()
    runs = sorted(
        (load_back(model, ns.clients, ns.rounds) for _ in range(ns.repeats)),
        key=lambda r: r["gbps"],
    )
    lb = {**runs[(len(runs) - 1) // 2], "gbps_runs": [r["gbps"] for r in runs]}
    mem = {
        "large_bytes": 512 * 2**20,
        "large": memcpy_gbps(512 * 2**20, repeats=10),
        "large_1t": memcpy_gbps(512 * 2**20, repeats=10, threads=1),
        "batch_bytes": lb["mean_batch_bytes"],
        "batch": memcpy_gbps(max(lb["mean_batch_bytes"], 4096)),
    }
    rss = decode_heavy(model, ns.requests, ns.prompt, ns.output)
    text = report(mem, lb, rss, ns)
    print(text)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"memcpy": mem, "load_back": lb, "rss": rss}))


if __name__ == "__main__":
    main()
