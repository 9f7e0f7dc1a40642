"""The warm-up a served engine runs before it says it is ready (SGLang's server warms up too;
`--skip-server-warmup` is its flag): the pool's largest decode step and one whole prefill chunk,
so that the first requests do not pay for the engine's first-time work (on a GPU: kernels'
first launches, the allocator's first buffers; on CPU: oneDNN's kernels for those shapes). vLLM
runs dummy batches before it serves for the same reason.

On CPU the steps alone did not close the first burst's gap (the first 64 streams after start ran
at 0.91× the third in `benchmarks/vllm_peer.py --bursts 3`): glibc handed the steps' freed
activations back to the system and the first burst's prefill steps faulted them in anew, ~1.6×
their later time. The engine now keeps its freed heap (engine/host_heap.py); this warm-up's
prefill then leaves a whole chunk's worth of it behind. And oneDNN builds a GEMM kernel per
row count it has not seen: the scheduler's budget counts a step's decode rows with its prompt
tokens (engine/scheduler.py), so a prefilling step under load has this prefill's row count.

Every rank runs the same warm-up on its own, before the ranks' start-up barrier: the same
requests, scheduled the same way, so the collectives of tensor parallelism and DP attention pair
up without a word on the bus. The warm-up leaves nothing behind: its requests bypass the radix
tree, the host and storage tiers and hidden-state capture, and the engine's counters start from
zero after it (the tests' step gate counts `tierserve_engine_steps_total`).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tierserve.args import EngineArgs
from tierserve.cache import KVCacheManager
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduler, SchedulerStats
from tierserve.model_config import ModelConfig
from tierserve.outputs import StepOutput
from tierserve.sampling_params import SamplingParams
from tierserve.speculative import SpecStats
from tierserve.storage import StorageTier

logger = logging.getLogger("tierserve")

# Before every real request (their arrivals count up from 0): the warm-up's sequence ids never
# meet a real request's in a workspace keyed by them.
_FIRST_ARRIVAL = -(2**40)
DECODE_PROMPT = 2  # tokens per decode row's prompt: one step prefills them, the next decodes


class Engine(Protocol):
    """What the warm-up uses of engine.Engine (named here: that module imports this one)."""

    args: EngineArgs
    kv: KVCacheManager
    storage: StorageTier | None
    scheduler: Scheduler
    spec_stats: SpecStats
    peak_running: int
    model_config: ModelConfig
    context_length: int
    _requests: dict[str, Request]

    def _step(self) -> list[StepOutput]: ...


def warm_up(engine: Engine) -> None:
    """Run the largest decode step the pool holds, then one prefill chunk; then forget them."""
    start = time.perf_counter()
    rows, chunk = _shapes(engine)
    kv, storage = engine.kv, engine.storage
    radix, kv_storage = kv.radix, kv.storage
    kv.radix = kv.storage = engine.storage = None  # nothing cached, stored or fetched
    try:
        _run(engine, [_request(engine, i, DECODE_PROMPT, 2) for i in range(rows)])
        if chunk > DECODE_PROMPT:
            longest = min(chunk, engine.context_length - 1)
            lengths = [longest] * (chunk // longest) + [chunk % longest] * (chunk % longest > 0)
            _run(engine, [_request(engine, rows + i, n, 1) for i, n in enumerate(lengths)])
    finally:
        kv.radix, kv.storage, engine.storage = radix, kv_storage, storage
    engine.scheduler.stats = SchedulerStats()
    engine.spec_stats = SpecStats()
    engine.peak_running = 0
    logger.info(
        "warm-up: a decode step of %d rows and a %d-token prefill in %.2f s",
        rows, chunk, time.perf_counter() - start,
    )  # fmt: skip


def _shapes(engine: Engine) -> tuple[int, int]:
    """Decode rows (the running cap, as many as the pool holds) and the prefill chunk's tokens:
    the whole budget, over several prompts where one cannot be that long, as a served step packs
    prompts up to it (the demo model's context is 1,024 tokens, its chunk 2,048)."""
    args, ps = engine.args, engine.kv.page_size
    pages = engine.kv.num_pages
    lookahead = engine.scheduler.lookahead + engine.args.num_speculative_tokens
    per_row = -(-(DECODE_PROMPT + 2 + lookahead) // ps)
    rows = max(1, min(args.max_running_requests // args.dp_groups, pages // per_row))
    budget = args.chunked_prefill_size if args.chunked_prefill_size > 0 else engine.context_length
    chunk = min(budget, (pages - 1) * ps - 1 - lookahead)
    return rows, chunk


def _request(engine: Engine, i: int, prompt_len: int, max_tokens: int) -> Request:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(
        rid=f"tierserve-warm-up-{i}",
        arrival=_FIRST_ARRIVAL + i,
        prompt_ids=[(3 + i + j) % vocab for j in range(prompt_len)],
        params=params,  # greedy: no generator, so the engine's seeded one is not touched
    )


def _run(engine: Engine, requests: list[Request]) -> None:
    for req in requests:
        engine._requests[req.rid] = req  # as a submitted request is: finishing drops it
        engine.scheduler.add(req)
    while engine.scheduler.has_work():
        engine._step()
