"""fp8 KV against the model's dtype, with the same pool memory in bytes, on the multi-turn
workload of hicache_multiturn.py (closed loop, every request allowed in flight, so the device
pool decides how many run at once).

Two configurations in one run: the model dtype's pool of N tokens, and an fp8_e4m3 pool of the
same bytes (N × the model dtype's width tokens; 4× on CPU's float32). Prints requests/s, the
most requests running in one step, the cache hit rate, and the ratios.

    .venv/bin/python benchmarks/kv_dtype.py [--model DIR] [--clients 32] [--rounds 4]
"""

from __future__ import annotations

import argparse

import torch
from hicache_multiturn import run  # the same workload and measurement

from tierserve.args import EngineArgs, default_model
from tierserve.engine.engine import Engine
from tierserve.engine.startup import Startup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--first-len", type=int, default=600)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--device-tokens", type=int, default=4096, help="model-dtype pool, tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the median")
    ns = p.parse_args()
    ns.max_in_flight = ns.clients  # the pool, not a client limit, bounds what runs
    model = ns.model or default_model()
    assert model, "no demo model bundled; pass --model"
    vocab = Engine.vocab_size_of(model)
    base = EngineArgs(model=model, page_size=ns.page_size, chunked_prefill_size=2048)
    full = run("model dtype", base.replace(max_total_tokens=ns.device_tokens), ns, vocab)
    width = Startup.from_args(base.replace(max_total_tokens=ns.page_size)).dtype.itemsize
    fp8_args = base.replace(max_total_tokens=ns.device_tokens * width, kv_cache_dtype="fp8_e4m3")
    fp8 = run("fp8_e4m3", fp8_args, ns, vocab)
    print(
        f"model {model}; {ns.clients} clients × {ns.rounds} rounds, all in flight; first "
        f"{ns.first_len}, question {ns.question_len}, output {ns.output_len} tokens; pool "
        f"{ns.device_tokens} model-dtype tokens = "
        f"{ns.device_tokens * width} fp8 tokens; threads {torch.get_num_threads()}"
    )
    print(f"{'KV dtype':<12} {'req/s':>8} {'peak running':>13} {'hit rate':>9}")
    for r in (full, fp8):
        print(f"{r.name:<12} {r.throughput:8.2f} {r.peak_running:13d} {r.hit_rate:9.1%}")
    print(
        f"fp8 / model dtype: {fp8.throughput / full.throughput:.2f}× throughput, "
        f"{fp8.peak_running / max(1, full.peak_running):.2f}× requests running at once"
    )


if __name__ == "__main__":
    main()
