"""Which linear layout is faster on this CPU: F.linear on the dense weight (float32: MKL's sgemm;
bf16: oneDNN, re-blocking the weight each call) or oneDNN on a weight reordered once at load
(layers/cpu_linear.py), per dtype, GEMM shape of the demo model and row count.

    .venv/bin/python benchmarks/cpu_linear_layout.py [--rounds 5] [--rows 1,8,64,512]

Each figure is the median over rounds of a call's mean time (200 calls after 30 warm ones),
the two layouts alternating within a round; torch's threads as the engine gets them offline
(every core). Writes benchmarks/results/cpu-linear-layout/report.md, with the layout the
loader picks here (`packed_dtypes`) beside the faster one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierserve.bench.report import machine_info
from tierserve.layers.cpu_linear import cpu_vendor, linear, onednn_dtypes, packed_dtypes

OUT = Path(__file__).parent / "results" / "cpu-linear-layout"
# The demo model's GEMMs as the engine runs them ([in, out]): fused q/k/v, o, fused gate/up,
# down, the LM head.
SHAPES = {"qkv": (256, 384), "o": (256, 256), "gate/up": (256, 1536), "down": (768, 256)}
SHAPES["LM head"] = (256, 4096)
CALLS, WARM_CALLS = 200, 30


def call_us(fn: Callable[[], object]) -> float:
    for _ in range(WARM_CALLS):
        fn()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - start) / CALLS * 1e6


def measure(dtype: torch.dtype, rows: list[int], rounds: int) -> dict[tuple[str, int], tuple]:
    """(shape, rows) → (dense µs, reordered µs), medians of the rounds."""
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, dtype=dtype) for name, (k, n) in SHAPES.items()}
    packed = {name: torch.ops.mkldnn._reorder_linear_weight(w, None) for name, w in weights.items()}
    with torch.inference_mode():
        for r in range(rounds):
            for name, w in weights.items():
                for m in rows:
                    x = torch.randn(m, w.shape[1], dtype=dtype)
                    ways = (w, packed[name]) if r % 2 == 0 else (packed[name], w)
                    times = [call_us(lambda x=x, v=v: linear(x, v)) for v in ways]
                    dense, reordered = times if r % 2 == 0 else times[::-1]
                    got.setdefault((name, m), []).append((dense, reordered))
    return {
        key: (statistics.median(d for d, _ in v), statistics.median(p for _, p in v))
        for key, v in got.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,8,64,512")
    ns = ap.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    if not onednn_dtypes():
        raise SystemExit("torch is built without oneDNN here: every linear stays dense")
    picked = packed_dtypes(cpu_vendor())
    cpu = machine_info().get("cpu_model", "an unnamed CPU")
    lines = [
        "# Linear layouts on this CPU",
        "",
        f"`.venv/bin/python benchmarks/cpu_linear_layout.py --rounds {ns.rounds} --rows "
        f"{ns.rows}` on {cpu} ({cpu_vendor() or 'vendor unknown'}), "
        f"{torch.get_num_threads()} torch threads. µs a call, medians of {ns.rounds} rounds.",
        "",
    ]
    for dtype in onednn_dtypes():
        res = measure(dtype, rows, ns.rounds)
        choice = "reordered" if dtype in picked else "dense"
        lines += [f"## {str(dtype).removeprefix('torch.')}: the loader picks {choice} here", ""]
        lines += ["| GEMM [in, out] | rows | dense F.linear | reordered | dense / reordered |"]
        lines += ["| --- | ---: | ---: | ---: | ---: |"]
        for (name, m), (dense, packed) in res.items():
            k, n = SHAPES[name]
            lines.append(
                f"| {name} [{k}, {n}] | {m} | {dense:.1f} | {packed:.1f} | {dense / packed:.2f}× |"
            )
        lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
