"""Multi-turn benchmark of the hierarchical cache, three configurations in one run.

C clients hold R-round conversations (SGLang bench_multiturn semantics, closed loop): round 0 is
an L-token prompt; each later round appends the model's output and a new S-token question. At
most P requests are in flight (SGLang's --max-parallel); a client whose request finishes queues
its next round behind the clients already waiting. Configurations:
  device-only  a device pool that holds about a quarter of the conversations;
  hicache      the same pool plus a host tier;
  limit        a device pool big enough for everything.
Prints throughput, mean TTFT of rounds >= 1 and cache hit rate, and the ratios.

    .venv/bin/python benchmarks/hicache_multiturn.py [--model DIR] [--clients 32] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierserve import SamplingParams
from tierserve.args import EngineArgs, default_model
from tierserve.engine.engine import Engine


@dataclass
class Client:
    history: list[int]
    round: int = 0
    rid: str | None = None
    sent: float = 0.0
    first: float | None = None
    answer: list[int] = field(default_factory=list)  # the current round's output ids
    ttfts: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Result:
    name: str
    seconds: float
    requests: int
    ttft_later_rounds: float
    hit_rate: float
    host_hit_tokens: int
    peak_running: int = 0  # most requests running in one step

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def tokens(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def warm_up(engine: Engine, vocab: int) -> None:
    """A few steps first, so one-time start-up costs land outside the measurement."""
    g = torch.Generator().manual_seed(12345)
    for _ in range(2):
        engine.add_request(tokens(300, vocab, g), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.flush_cache()


def run(name: str, args: EngineArgs, ns: argparse.Namespace, vocab: int) -> Result:
    """The median-throughput run of `ns.repeats`, each on a flushed cache."""
    engine = Engine(args)
    warm_up(engine, vocab)
    runs = []
    for _ in range(ns.repeats):
        engine.flush_cache()
        runs.append(run_once(name, engine, ns, vocab))
    return sorted(runs, key=lambda r: r.throughput)[(len(runs) - 1) // 2]


def run_once(name: str, engine: Engine, ns: argparse.Namespace, vocab: int) -> Result:
    host_before = engine.kv.host.stats.host_hit_tokens if engine.kv.host else 0
    g = torch.Generator().manual_seed(ns.seed)
    clients = [Client(tokens(ns.first_len, vocab, g)) for _ in range(ns.clients)]
    questions = [[tokens(ns.question_len, vocab, g) for _ in range(ns.rounds)] for _ in clients]
    params = SamplingParams(max_tokens=ns.output_len, temperature=0, ignore_eos=True)
    by_rid: dict[str, Client] = {}
    prompt_tokens = cached_tokens = done = 0

    def send(c: Client) -> None:
        c.rid = engine.add_request(c.history, params)
        c.sent, c.first, c.answer = time.perf_counter(), None, []
        by_rid[c.rid] = c

    ready = deque(clients)
    start, peak = time.perf_counter(), 0
    while ready or engine.has_unfinished():
        while ready and len(by_rid) < ns.max_in_flight:
            send(ready.popleft())
        outputs = engine.step()
        peak = max(peak, len(engine.scheduler.running))
        for out in outputs:
            c = by_rid[out.request_id]
            c.answer.append(out.token_id)
            if c.first is None:
                c.first = time.perf_counter()
                c.ttfts.append((c.round, c.first - c.sent))
            if not out.finished:
                continue
            done += 1
            del by_rid[out.request_id]
            prompt_tokens += out.prompt_tokens
            cached_tokens += out.cached_tokens
            c.history = c.history + c.answer + questions[clients.index(c)][c.round]
            c.round += 1
            if c.round < ns.rounds:
                ready.append(c)
    seconds = time.perf_counter() - start
    later = [t for c in clients for r, t in c.ttfts if r >= 1]
    host = (engine.kv.host.stats.host_hit_tokens - host_before) if engine.kv.host else 0
    hit_rate = cached_tokens / prompt_tokens
    return Result(name, seconds, done, statistics.mean(later), hit_rate, host, peak)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-in-flight", type=int, default=8, help="requests in flight at most")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--first-len", type=int, default=600)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--device-tokens", type=int, default=0, help="default: a quarter of the total")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or default_model()
        if model is None:
            from offline_throughput import random_init_model

            model = random_init_model(Path(tmp))
        vocab = Engine.vocab_size_of(model)
        final_len = ns.first_len + ns.rounds * (ns.question_len + ns.output_len)
        total = ns.clients * final_len
        small = ns.device_tokens or total // 4
        base = EngineArgs(model=model, page_size=ns.page_size, chunked_prefill_size=2048)
        configs = [
            ("device-only", base.replace(max_total_tokens=small)),
            (
                "hicache",
                base.replace(
                    max_total_tokens=small, enable_hierarchical_cache=True, hicache_ratio=8
                ),
            ),
            ("limit", base.replace(max_total_tokens=total * 2)),
        ]
        results = [run(name, args, ns, vocab) for name, args in configs]
    print(
        f"model {model}; {ns.clients} clients × {ns.rounds} rounds, {ns.max_in_flight} in "
        f"flight; first {ns.first_len}, "
        f"question {ns.question_len}, output {ns.output_len} tokens; device pool {small} tokens "
        f"(all conversations: {total}); threads {torch.get_num_threads()}"
    )
    print(f"{'config':<12} {'req/s':>8} {'TTFT r>=1 (s)':>14} {'hit rate':>9} {'host hits':>10}")
    for r in results:
        print(
            f"{r.name:<12} {r.throughput:8.2f} {r.ttft_later_rounds:14.3f} "
            f"{r.hit_rate:9.1%} {r.host_hit_tokens:10,}"
        )
    dev, hi, lim = results
    print(f"hicache / device-only throughput: {hi.throughput / dev.throughput:.2f}x (target >= 4)")
    print(
        f"hicache / limit throughput:       {hi.throughput / lim.throughput:.2f}x (target >= 0.9)"
    )
    print(
        f"TTFT rounds >= 1, hicache vs device-only: "
        f"{1 - hi.ttft_later_rounds / dev.ttft_later_rounds:.0%} lower (target >= 80%)"
    )


if __name__ == "__main__":
    main()
