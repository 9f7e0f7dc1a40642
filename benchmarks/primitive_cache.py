"""Memory oneDNN's GEMM primitive caches hold, unbounded (torch's default) and as tierserve
bounds them (layers/cpu_linear.py, PRIMITIVE_CACHE_CAPACITY).

    .venv/bin/python benchmarks/primitive_cache.py [--rows 1024]

Each setting runs in a process of its own: the demo model's linear shapes, reordered as the
loader reorders them, each multiplied at 1, 2, ... `--rows` rows, as a serving engine meets
row counts (a prefill chunk's tokens, a decode batch's size). The process's resident memory
is read every 128 row counts. Writes benchmarks/results/primitive-cache/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).parent / "results" / "primitive-cache"
SETTINGS = {"torch's default (1,024 each)": None, "tierserve's bound (256 each)": "256"}
VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

CHILD = """
import json, sys, torch
from tierserve.args import default_model
from tierserve.model_config import ModelConfig

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024

cfg = ModelConfig.from_dir(default_model())
h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
shapes = [(h, qkv), (cfg.num_heads * d, h), (h, 2 * i), (i, h), (h, cfg.vocab_size)]
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, k), None) for k, o in shapes]
readings = [(0, rss_mb())]
for rows in range(1, int(sys.argv[1]) + 1):
    for (k, _), w in zip(shapes, weights):
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, k), w, None, "none", [], "")
    if rows % 128 == 0:
        readings.append((rows, rss_mb()))
print(json.dumps(readings))
"""


def run(capacity: str | None, rows: int) -> list[tuple[int, int]]:
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    if capacity is not None:
        env |= dict.fromkeys(VARS, capacity)
    done = subprocess.run([sys.executable, "-c", CHILD, str(rows)], env=env, check=True,
                          capture_output=True, text=True)  # fmt: skip
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    ns = parser.parse_args()
    results = {name: run(capacity, ns.rows) for name, capacity in SETTINGS.items()}
    counts = [r for r, _ in next(iter(results.values()))]
    lines = [
        "# oneDNN's primitive caches: resident memory by row counts met",
        "",
        f"`.venv/bin/python benchmarks/primitive_cache.py --rows {ns.rows}` (the demo model's "
        "five linear shapes, reordered; each multiplied at every row count up to the one "
        "shown; MB resident, one process per setting).",
        "",
        "| row counts met | " + " | ".join(results) + " |",
        "| ---: | " + " | ".join("---:" for _ in results) + " |",
    ]
    for k, rows in enumerate(counts):
        lines.append(f"| {rows} | " + " | ".join(str(r[k][1]) for r in results.values()) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
