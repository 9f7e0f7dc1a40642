"""Prometheus metrics: request latencies observed by the routes, engine and cache state read
from the engine at scrape time (so the numbers can never drift from the engine's own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierserve.engine import Engine
from tierserve.server.grammar_pool import GrammarCompilePool
from tierserve.storage import StorageTier

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        sched = e.scheduler
        yield _gauge(
            "tierserve_num_requests_running",
            "requests being decoded or prefilled",
            len(sched.running),
        )
        yield _gauge("tierserve_num_requests_waiting", "requests queued", len(sched.waiting))
        yield _counter(
            "tierserve_prompt_tokens", "prompt tokens admitted", sched.stats.num_prompt_tokens
        )
        yield _counter(
            "tierserve_generation_tokens", "tokens generated", sched.stats.num_generated_tokens
        )
        yield _counter("tierserve_engine_steps", "batches the engine ran", sched.stats.num_steps)
        yield _counter(
            "tierserve_recomputed_tokens",
            "tokens computed again after preemption",
            sched.stats.num_recomputed_tokens,
        )
        preempt = CounterMetricFamily(
            "tierserve_preemptions", "preempted requests", labels=["kind"]
        )
        offload = sched.stats.num_offload_preemptions
        preempt.add_metric(["offload"], offload)
        preempt.add_metric(["recompute"], sched.stats.num_preemptions - offload)
        yield preempt
        yield from self._tiers()
        yield from self._memory()
        if e.storage is not None:
            yield from _storage(e.storage)

    def _memory(self) -> Iterator[Metric]:
        """KV bytes allocated, per rank and per node. Every rank holds its own device pool; a
        host copy shared by a group of ranks counts once on the node, and a rank's share of
        it is its part. Page and token counts elsewhere are per rank (the ranks' trees are
        the same), so they need no node figure."""
        plan, args = self.engine.kv_plan, self.engine.args
        kv = GaugeMetricFamily(
            "tierserve_kv_bytes", "KV memory allocated", labels=["tier", "scope"]
        )
        kv.add_metric(["device", "rank"], plan.device_bytes)
        kv.add_metric(["device", "node"], plan.device_bytes * args.local_ranks)
        if plan.host is not None:
            kv.add_metric(["host", "rank"], plan.host.bytes_per_rank)
            kv.add_metric(["host", "node"], plan.host.bytes_per_node)
        yield kv
        yield _gauge("tierserve_tp_size", "tensor-parallel ranks", args.tp_size)
        yield _gauge("tierserve_local_ranks", "ranks on this node", args.local_ranks)
        sharing = plan.host.sharing if plan.host is not None else 1
        yield _gauge(
            "tierserve_host_copy_sharing", "ranks that share one host copy of their KV", sharing
        )

    def _tiers(self) -> Iterator[Metric]:
        kv = self.engine.kv
        host = kv.host
        used = GaugeMetricFamily("tierserve_kv_pages_used", "pages in use", labels=["tier"])
        total = GaugeMetricFamily("tierserve_kv_pages_total", "pages in the pool", labels=["tier"])
        cached = GaugeMetricFamily(
            "tierserve_radix_cached_pages", "pages the radix cache holds", labels=["tier"]
        )
        used.add_metric(["device"], kv.num_pages - kv.allocator.num_free)
        total.add_metric(["device"], kv.num_pages)
        cached.add_metric(["device"], kv.cached_pages())
        hits = CounterMetricFamily(
            "tierserve_cached_tokens", "prompt tokens served from cache", labels=["tier"]
        )
        if host is None:
            hits.add_metric(["device"], self.engine.scheduler.stats.num_cached_tokens)
            yield from (used, total, cached, hits)
            return
        used.add_metric(["host"], host.used_pages)
        total.add_metric(["host"], host.host_pool.num_pages)
        cached.add_metric(["host"], kv.radix.host_pages if kv.radix else 0)
        hits.add_metric(["device"], host.stats.device_hit_tokens)
        hits.add_metric(["host"], host.stats.host_hit_tokens)
        yield from (used, total, cached, hits)
        s = host.stats
        yield _counter(
            "tierserve_host_written_tokens", "tokens copied to the host tier", s.host_written_tokens
        )
        yield _counter(
            "tierserve_load_back_tokens", "tokens loaded back from the host", s.load_back_tokens
        )
        yield _counter(
            "tierserve_load_back_bytes", "bytes loaded back from the host", s.load_back_bytes
        )
        yield _counter(
            "tierserve_load_back_seconds", "time spent loading back", s.load_back_seconds
        )
        evicted = CounterMetricFamily("tierserve_evicted_tokens", "tokens evicted", labels=["tier"])
        evicted.add_metric(["device"], s.device_evicted_tokens)
        evicted.add_metric(["host"], s.host_evicted_tokens)
        yield evicted
        yield _counter("tierserve_backup_bytes", "bytes copied to the host tier", s.backup_bytes)
        yield _gauge("tierserve_copies_in_flight", "tier copies issued, not landed", host.in_flight)
        yield _counter(
            "tierserve_deferred_evictions",
            "device evictions deferred because a copy of the node was in flight",
            kv.radix.deferred_evictions if kv.radix else 0,
        )
        yield _counter(
            "tierserve_copy_waits",
            "times device pages were needed before copies landed",
            s.forced_waits,
        )


# The storage tier's counters, tierserve_storage_<field>: (StorageStats field, help).
STORAGE_COUNTERS = (
    ("hit_pages", "pages found in storage and loaded into the host tier"),
    ("miss_pages", "pages looked up in storage and not fetched"),
    ("read_bytes", "bytes read from storage"),
    ("read_seconds", "time in storage reads"),
    ("written_pages", "pages written to storage"),
    ("written_bytes", "bytes written to storage"),
    ("write_seconds", "time in storage writes"),
    ("prefetches", "prefetches started"),
    ("timeouts", "storage calls abandoned after their timeout"),
    ("errors", "storage calls that failed"),
    ("corrupt_objects", "objects whose header or checksum did not match"),
    ("dropped_writes", "pages not written: queue full or store unavailable"),
    ("breaker_opens", "times the circuit breaker opened"),
    ("breaker_skips", "storage calls skipped while the breaker was open"),
)


def _storage(storage: StorageTier) -> Iterator[Metric]:
    stats = storage.stats.as_dict()
    for field, doc in STORAGE_COUNTERS:
        yield _counter(f"tierserve_storage_{field}", doc, stats[field])
    state = GaugeMetricFamily(
        "tierserve_storage_breaker", "circuit breaker state (1 = current)", labels=["state"]
    )
    for name in ("closed", "open", "half-open"):
        state.add_metric([name], float(storage.store.state == name))
    yield state


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class GrammarCollector(Collector):
    """The compile pool's ended compiles, by why: the client left, the time limit, a crash, the
    server stopping."""

    REASONS = ("client_left", "timeout", "crashed", "shutdown")

    def __init__(self, pool: GrammarCompilePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        ended = CounterMetricFamily(
            "tierserve_grammar_compiles_ended",
            "grammar compiles ended before they finished",
            labels=["reason"],
        )
        for reason in self.REASONS:
            ended.add_metric([reason], self.pool.ended[reason])
        yield ended
        yield _gauge("tierserve_grammar_compile_workers", "compile processes", len(self.pool.pids))
        yield _gauge(
            "tierserve_grammar_compiles_in_flight",
            "compiles queued or running",
            self.pool.in_flight,
        )


class ServerMetrics:
    def __init__(self, engine: Engine, grammar_pool: GrammarCompilePool | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        if grammar_pool is not None:
            self.registry.register(GrammarCollector(grammar_pool))
        self.requests = Counter(
            "tierserve_requests", "finished requests by status", ["status"], registry=self.registry
        )
        self.ttft = self._histogram("tierserve_time_to_first_token_seconds", "time to first token")
        self.tpot = self._histogram("tierserve_time_per_output_token_seconds", "per output token")
        self.e2e = self._histogram("tierserve_e2e_request_latency_seconds", "end-to-end latency")

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
