"""Tier copies that land late, in random order: the bookkeeping of in-flight copies under random
workloads (every write policy, aborts, offload preemption, flushes), checked at every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams
from tierserve.args import EngineArgs
from tierserve.cache.pool import PagedKV
from tierserve.cache.transfer import CopyOp, TransferBackend, copy_pages
from tierserve.engine.engine import Engine


class DelayedTransfer(TransferBackend):
    """Lands each op 1..max_delay polls after it is issued, in random order. The pages move only
    when the op lands, so anything that reads, frees or reuses pages early sees wrong KV."""

    def __init__(
        self, device_pool: PagedKV, host_pool: PagedKV, rng: random.Random, max_delay: int = 3
    ) -> None:
        super().__init__(device_pool, host_pool)
        self.rng, self.max_delay = rng, max_delay
        self.due: dict[CopyOp, int] = {}

    def poll(self) -> list[CopyOp]:
        self.rng.shuffle(self.in_flight)  # random landing order among the due ones
        return super().poll()

    def _start(self, op: CopyOp) -> None:
        self.due[op] = self.rng.randint(1, self.max_delay)

    def _landed(self, op: CopyOp) -> bool:
        self.due[op] -= 1
        if self.due[op] > 0:
            return False
        self._wait(op)
        return True

    def _wait(self, op: CopyOp) -> None:
        if self.due.pop(op, None) is not None:
            src, dst = self._endpoints(op)
            copy_pages(src, op.src, dst, op.dst, non_blocking=False)


GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy outputs with no cache at all, by prompt."""
    llm = LLM(str(llama_dir), disable_radix_cache=True, max_total_tokens=4096)
    memo: dict[tuple[int, ...], list[int]] = {}

    def outputs(prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in memo or len(memo[key]) < max_tokens:
            params = SamplingParams(max_tokens=max(max_tokens, 24), **GREEDY)
            memo[key] = llm.generate([prompt], params)[0].token_ids
        return memo[key][:max_tokens]

    return outputs


events = st.lists(
    st.tuples(
        st.sampled_from(["add"] * 6 + ["step"] * 3 + ["abort", "flush"]),
        st.integers(0, 2),  # which shared prefix
        st.integers(0, 32),  # tail length
        st.integers(1, 24),  # max_tokens, or steps to run, or which request to abort
    ),
    min_size=6,
    max_size=30,
)


def test_copies_in_flight_keep_outputs_and_accounting(llama_dir, reference):
    totals: Counter[str] = Counter()
    prefixes = random_prompts(3, [64, 40, 96], seed=90)

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,  # the same workloads on every run: CI stays reproducible
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        page_size=st.sampled_from([1, 8, 16]),
        seed=st.integers(0, 2**16),
        script=events,
    )
    def run(policy: str, page_size: int, seed: int, script: list) -> None:
        rng = random.Random(seed)
        args = EngineArgs(
            model=str(llama_dir),
            page_size=page_size,
            max_total_tokens=192,
            chunked_prefill_size=64,
            enable_hierarchical_cache=True,
            hicache_ratio=3,
            hicache_write_policy=policy,
        )
        engine = Engine(args, transfer=lambda d, h: DelayedTransfer(d, h, rng))
        expected: dict[str, list[int]] = {}
        got: dict[str, list[int]] = {}
        aborted: set[str] = set()

        def step() -> None:
            for out in engine.step():
                got.setdefault(out.request_id, []).append(out.token_id)
            engine.check_accounting()

        for i, (op, which, tail, n) in enumerate(script):
            if op == "add":
                prompt = prefixes[which] + random_prompts(1, [tail + 1], seed=seed + i)[0]
                rid = engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))
                expected[rid] = reference(prompt, n)
            elif op == "step":
                for _ in range(n):
                    step()
            elif op == "abort" and expected:
                rid = sorted(expected)[n % len(expected)]
                aborted.add(rid)
                engine.abort(rid)
            elif op == "flush":
                engine.flush_cache()
                engine.check_accounting()
        for _ in range(5000):
            if not engine.has_unfinished():
                break
            step()
        assert not engine.has_unfinished(), "the engine never finished"
        for rid, want in expected.items():
            if rid in aborted:
                assert want[: len(got.get(rid, []))] == got.get(rid, []), rid
            else:
                assert got[rid] == want, (rid, policy, page_size)
        stats, host = engine.scheduler.stats, engine.kv.host.stats
        totals["steps with copies in flight"] += stats.steps_with_copies_in_flight
        totals["steps a request waited on its load"] += stats.steps_waiting_on_load
        totals["evictions deferred"] += engine.kv.radix.deferred_evictions
        totals["offload preemptions"] += stats.num_offload_preemptions
        totals["host hits"] += host.host_hit_tokens
        totals["forced waits"] += host.forced_waits

    run()
    print(dict(totals))
    assert totals["steps with copies in flight"] > 0
    assert totals["steps a request waited on its load"] > 0
    assert totals["evictions deferred"] > 0
    assert totals["offload preemptions"] > 0
    assert totals["host hits"] > 0
