"""Why the offline `LLM` keeps its engine in the caller's process: `LLM.generate` against the
same requests sent to an engine core process (the server's, engine/core.py) by a client that
does nothing else, in alternating rounds, the prefix cache flushed before each.

The 64 prompts of benchmarks/served_cpu_split.py (64–512 token ids × 128 greedy tokens, EOS
ignored, demo model). The core's client reads token ids only (no detokenization), so the
difference is the process boundary: messages, their encoding and the socket.

    .venv/bin/python benchmarks/offline_core.py [--rounds 3]

Writes benchmarks/results/offline-core/report.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from served_cpu_split import PARAMS, prompts  # this folder is on the path of a script run from it

from tierserve import LLM, SamplingParams
from tierserve.args import EngineArgs, default_model
from tierserve.core_messages import Ask, FlushCache, StepOutputs
from tierserve.server.core_client import CoreClient

OUT = Path(__file__).parent / "results" / "offline-core"


def in_process(llm: LLM, batch: list[list[int]]) -> float:
    llm.engine.flush_cache()
    start = time.perf_counter()
    outs = llm.generate(batch, PARAMS)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def through_core(core: CoreClient, batch: list[list[int]], round_: int) -> float:
    from tierserve.engine import RequestPreparer

    core.send(Ask(round_, FlushCache()))
    preparer = RequestPreparer(core.info, tokenizer=None)  # token ids need no tokenizer
    messages = core.messages()
    next(m for m in messages if not isinstance(m, StepOutputs))  # the flush's answer
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        core.send(preparer.prepare(ids, PARAMS, f"{round_}-{i}", preparer.next_arrival()))
    tokens, finished = 0, 0
    for message in messages:
        if isinstance(message, StepOutputs):
            tokens += len(message.outputs)
            finished += sum(o.finished for o in message.outputs)
            if finished == len(batch):
                break
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    batch = prompts()
    model = default_model()
    llm = LLM(model, max_total_tokens=65536)
    core = CoreClient.start(EngineArgs.from_kwargs(model, max_total_tokens=65536), "warning")
    llm.generate(batch[:2], SamplingParams(max_tokens=4))  # warm-up, both
    through_core(core, batch[:2], -1)
    rows = []
    try:
        for r in range(ns.rounds):
            rows.append((in_process(llm, batch), through_core(core, batch, r)))
            print(f"round {r}: in-process {rows[-1][0]:.0f} tok/s, core {rows[-1][1]:.0f}")
    finally:
        core.stop()
        llm.close()
    lines = [
        "# Offline: the engine in the caller's process, or behind the core's socket",
        "",
        f"`.venv/bin/python benchmarks/offline_core.py --rounds {ns.rounds}` (demo model, 2-core",
        "CPU; 64 prompts of 64–512 token ids × 128 greedy tokens; prefix cache flushed before",
        "each; the core's client reads token ids only)",
        "",
        "| round | `LLM.generate` tok/s | through the core tok/s | core / in-process |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {i} | {a:.0f} | {b:.0f} | {b / a:.2f}× |" for i, (a, b) in enumerate(rows)),
        "",
        f"Median core / in-process: {statistics.median(b / a for a, b in rows):.2f}×.",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
