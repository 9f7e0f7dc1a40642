"""What a store outage costs a request: latencies of the same long prompts with no storage, with
a healthy Mooncake Store holding their pages, with its master killed, after it is back, and with
a store that answers slowly. The tests hold outputs and counters; the latencies are here.

In-process engines on the bundled demo model, one prompt at a time (600 tokens, 8 greedy
tokens); before each measured prompt the device and host tiers are flushed, so a hit can only
come from storage. Default storage settings (2 s call timeout, breaker after 3 failures for
5 s, prefetch policy `timeout`).

    .venv/bin/python benchmarks/storage_outage.py [--prompts 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tierserve import LLM, SamplingParams
from tierserve.storage.file import FileBackend
from tierserve.storage.mooncake import MooncakeMaster
from tierserve.storage.registry import register

OUT = Path(__file__).parent / "results" / "storage-outage"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@register("slow-file")
class SlowFile(FileBackend):
    """A file store behind a slow link: every call waits `delay_s` first."""

    def __init__(self, extra: Any) -> None:
        super().__init__(extra)
        self.delay_s = float(extra.get("delay_s", 3.0))

    def exists(self, keys: list[str]) -> list[bool]:
        time.sleep(self.delay_s)
        return super().exists(keys)

    def put(self, items: Any) -> None:
        time.sleep(self.delay_s)
        super().put(items)


def engine(backend: str | None, extra: dict | None = None) -> LLM:
    args: dict[str, Any] = {"page_size": 16, "max_total_tokens": 4096}
    if backend:
        args |= {
            "enable_hierarchical_cache": True,
            "hicache_storage_backend": backend,
            "hicache_storage_backend_extra_config": json.dumps(extra or {}),
            "hicache_storage_prefetch_policy": "timeout",
        }
    return LLM(**args)


def measure(llm: LLM, prompts: list[list[int]]) -> dict[str, Any]:
    """Per prompt, tiers flushed first: seconds and cached tokens; the phase's own counters."""
    storage = llm.engine.storage
    before = storage.stats.as_dict() if storage else {}
    seconds, cached = [], []
    for p in prompts:
        llm.engine.flush_cache()
        start = time.perf_counter()
        out = llm.generate(p, GREEDY)[0]
        seconds.append(time.perf_counter() - start)
        cached.append(out.cached_tokens)
    after = storage.stats.as_dict() if storage else {}
    stats = {k: after[k] - before[k] for k in after}
    return {
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "cached_tokens_mean": sum(cached) / len(cached),
        "timeouts": stats.get("timeouts", 0),
        "errors": stats.get("errors", 0),
        "breaker_opens": stats.get("breaker_opens", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--out", type=Path, default=OUT)
    ns = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, 4096, (600,), generator=g).tolist() for _ in range(ns.prompts)]
    later = [torch.randint(16, 4096, (600,), generator=g).tolist() for _ in range(ns.prompts)]
    phases: list[tuple[str, dict[str, Any]]] = []

    plain = engine(None)
    plain.generate(prompts[0], GREEDY)  # warm-up
    phases.append(("no storage (recompute)", measure(plain, prompts)))

    master = MooncakeMaster()
    llm = engine("mooncake", master.extra())
    llm.generate(prompts, GREEDY)
    llm.engine.storage.flush_writes()
    phases.append(("Mooncake up, pages stored", measure(llm, prompts)))
    master.stop()
    phases.append(("master killed", measure(llm, prompts)))
    master.start()
    time.sleep(5.5)  # past the breaker's cooldown
    llm.generate(later, GREEDY)  # written again once the master is back
    llm.engine.storage.flush_writes()
    phases.append(("master back, new pages stored", measure(llm, later)))
    llm.engine.close()
    master.stop()

    with tempfile.TemporaryDirectory() as tmp:
        slow = engine("slow-file", {"path": tmp, "delay_s": 3.0})
        phases.append(("store answering in 3 s", measure(slow, prompts)))
        slow.engine.close()

    write(ns.out, phases)


def write(out: Path, phases: list[tuple[str, dict[str, Any]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(phases), indent=2))
    rows = "\n".join(
        f"| {name} | {m['median_s']:.3f} s | {m['max_s']:.3f} s | {m['cached_tokens_mean']:.0f} "
        f"| {m['timeouts']:.0f} | {m['errors']:.0f} | {m['breaker_opens']:.0f} |"
        for name, m in phases
    )
    (out / "report.md").write_text(
        "# A store outage, in latency\n\n`.venv/bin/python benchmarks/storage_outage.py`\n\n"
        "| phase | median | max | cached tokens (mean of 600) | timeouts | errors | "
        "breaker opens |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        f"{rows}\n"
    )
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
