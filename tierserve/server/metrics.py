"""Prometheus metrics: request latencies observed by the routes, the grammar compile pool's
counts, and the engine and cache state the core reads for each scrape (engine/metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierserve.core_messages import MetricFamily
from tierserve.frontend import GrammarCompilePool
from tierserve.server.vllm_metrics import VllmNames

# A `*_created` gauge beside every counter and histogram is prometheus_client's default, not
# Prometheus' convention; vLLM turns them off too.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector(Collector):
    """The families the engine core sent for this scrape (engine/metrics.py), as Prometheus
    metrics."""

    def __init__(self) -> None:
        self.families: list[MetricFamily] = []
        self.age_s: float | None = 0.0  # how old they are (None: the core never answered)

    def collect(self) -> Iterator[Metric]:
        stale = self.age_s is None or self.age_s > 0
        yield _gauge(
            "tierserve_engine_metrics_stale",
            "1: the engine core did not answer within the bound (docs/server.md), so its "
            "families below are its last answer's",
            float(stale),
        )
        if self.age_s is not None:
            age = "seconds since the engine core's families below were read (0: this scrape)"
            yield _gauge("tierserve_engine_metrics_age_seconds", age, self.age_s)
        for f in self.families:
            kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            family = kind(f.name, f.doc, labels=f.labels)
            for values, value in f.samples:
                family.add_metric(values, value)
            yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


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
    def __init__(
        self,
        grammar_pool: GrammarCompilePool | None = None,
        model_name: str | None = None,
        waiting_for_ids: Callable[[], int] | None = None,
    ) -> None:
        """`model_name`: the served model's, for vLLM's names of the metrics (none without).
        `waiting_for_ids`: the API process's requests whose id an aborted one still holds."""
        self.registry = CollectorRegistry()
        self._engine = EngineCollector()
        self.registry.register(self._engine)
        if grammar_pool is not None:
            self.registry.register(GrammarCollector(grammar_pool))
        self.requests = Counter(
            "tierserve_requests", "finished requests by status", ["status"], registry=self.registry
        )
        if waiting_for_ids is not None:
            Gauge(
                "tierserve_requests_waiting_for_id",
                "requests whose id an aborted request still holds in the engine core",
                registry=self.registry,
            ).set_function(waiting_for_ids)
        self.ttft = self._histogram("tierserve_time_to_first_token_seconds", "time to first token")
        self.tpot = self._histogram("tierserve_time_per_output_token_seconds", "per output token")
        self.e2e = self._histogram("tierserve_e2e_request_latency_seconds", "end-to-end latency")
        if model_name is not None:
            histograms = {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}
            families = lambda: self._engine.families  # noqa: E731
            self.registry.register(VllmNames(model_name, families, histograms, self.requests))

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self, engine_families: list[MetricFamily], age_s: float | None = 0.0) -> bytes:
        # On the event loop: one scrape at a time.
        self._engine.families, self._engine.age_s = engine_families, age_s
        return generate_latest(self.registry)
