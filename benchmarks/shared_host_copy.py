"""One shared host copy per node vs per-rank copies, at the same node budget, in one run.

Two tensor-parallel layouts whose ranks hold identical KV, as random-init checkpoints made on
the fly with KV of a few KB per token:
  mla  a DeepSeek-V3-shaped model at TP 2 (the latent is the same on both ranks);
  gqa  a Llama-shaped model with 2 KV heads at TP 4 (each head on two ranks).
Each runs hicache_multiturn.py's workload (clients in multi-turn conversations, a device pool
that holds a quarter of them) twice with the same `--hicache-size` per rank: with the shared
copy (the default) and with `--disable-shared-host-copy`. Prints the host tokens each rank's
tree can hold, the node's host bytes, the hit rate and the ratios.

    .venv/bin/python benchmarks/shared_host_copy.py [--clients 16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest's checkpoints

from hicache_multiturn import run_once

from tests.conftest import make_checkpoint
from tierserve.args import EngineArgs
from tierserve.engine.engine import Engine

LAYOUTS = {  # name: (family, tp, checkpoint overrides)
    "mla": ("deepseek-v3", 2, dict(kv_lora_rank=448)),
    "gqa": ("llama", 4, dict(head_dim=256, num_hidden_layers=4)),
}


def measure(args: EngineArgs, ns: argparse.Namespace) -> dict[str, float]:
    engine = Engine(args)
    try:
        result = run_once("", engine, ns, Engine.vocab_size_of(args.model))
        host = engine.kv_plan.host
        return {
            "host_tokens_per_rank": host.tokens_per_rank,
            "host_bytes_per_rank": host.bytes_per_rank,
            "host_bytes_per_node": host.bytes_per_node,
            "sharing": host.sharing,
            "hit_rate": result.hit_rate,
            "host_hit_tokens": result.host_hit_tokens,
            "requests_per_s": result.throughput,
        }
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--first-len", type=int, default=300)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--host-fraction",
        type=float,
        default=0.5,
        help="per-rank host bytes: what holds this fraction of all conversations per rank",
    )
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args()
    final = ns.first_len + ns.rounds * (ns.question_len + ns.output_len)
    total = ns.clients * final
    device = total // 4 // 16 * 16
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, tp, overrides) in LAYOUTS.items():
            path = make_checkpoint(Path(tmp) / name, family, **overrides)
            base = EngineArgs(model=str(path), tp_size=tp, max_total_tokens=device)
            per_rank = _per_rank_bytes(base, int(total * ns.host_fraction))
            host = base.replace(enable_hierarchical_cache=True, hicache_size=f"{per_rank}B")
            results[name] = {
                "shared": measure(host, ns),
                "per-rank copies": measure(host.replace(disable_shared_host_copy=True), ns),
            }
    print(
        f"{ns.clients} clients × {ns.rounds} rounds, first {ns.first_len} tokens; device pool "
        f"{device} tokens per rank (all conversations: {total}); host: the bytes per rank at "
        f"which per-rank copies hold {ns.host_fraction:.0%} of all conversations"
    )
    head = f"{'layout':<6} {'host copy':<16} {'host tok/rank':>13} {'node host MB':>12}"
    print(f"{head} {'hit rate':>9} {'host hits':>10} {'req/s':>7}")
    for name, runs in results.items():
        for kind, r in runs.items():
            print(
                f"{name:<6} {kind:<16} {r['host_tokens_per_rank']:13,.0f} "
                f"{r['host_bytes_per_node'] / 1e6:12.1f} {r['hit_rate']:9.1%} "
                f"{r['host_hit_tokens']:10,.0f} {r['requests_per_s']:7.2f}"
            )
        shared, apart = runs["shared"], runs["per-rank copies"]
        print(
            f"{name:<6} shared / per-rank: host tokens "
            f"{shared['host_tokens_per_rank'] / apart['host_tokens_per_rank']:.2f}×, node bytes "
            f"{shared['host_bytes_per_node'] / apart['host_bytes_per_node']:.2f}×, hit rate "
            f"{shared['hit_rate']:.1%} vs {apart['hit_rate']:.1%}"
        )
    if ns.json:
        ns.json.write_text(json.dumps(results, indent=1))


def _per_rank_bytes(args: EngineArgs, tokens: int) -> int:
    """Bytes per rank at which per-rank copies hold `tokens` host tokens."""
    from tierserve.model_config import ModelConfig
    from tierserve.sizing.kv import KVSpec

    cfg = ModelConfig.from_dir(args.model)
    spec = KVSpec.from_model(cfg, "float32", args.page_size, tp=args.tp_size)
    return tokens * spec.bytes_per_token


if __name__ == "__main__":
    main()
