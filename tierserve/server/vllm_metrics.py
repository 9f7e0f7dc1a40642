"""vLLM's names for the metrics a vLLM dashboard reads (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...), each the same value as
a tierserve family of this scrape, labelled `model_name` and `engine` as vLLM labels them: a
Grafana board built for vLLM works against tierserve unchanged. The tierserve families are
the source; these are views of them, never counted apart."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierserve.core_messages import MetricFamily

# vLLM's name, its kind, and the tierserve engine family it shows (summed over its labels).
ENGINE_VIEWS = (
    ("vllm:num_requests_running", "gauge", "tierserve_num_requests_running"),
    ("vllm:num_requests_waiting", "gauge", "tierserve_num_requests_waiting"),
    ("vllm:prompt_tokens", "counter", "tierserve_prompt_tokens"),
    ("vllm:generation_tokens", "counter", "tierserve_generation_tokens"),
    ("vllm:num_preemptions", "counter", "tierserve_preemptions"),
    # Prompt tokens looked up in the prefix cache, and found there (any tier: none of them
    # was computed again).
    ("vllm:prefix_cache_queries", "counter", "tierserve_prompt_tokens"),
    ("vllm:prefix_cache_hits", "counter", "tierserve_cached_tokens"),
)
# vLLM's histograms, and the route's own tierserve one each shows.
HISTOGRAM_VIEWS = (
    ("vllm:time_to_first_token_seconds", "ttft"),
    ("vllm:request_time_per_output_token_seconds", "tpot"),
    ("vllm:e2e_request_latency_seconds", "e2e"),
)
LABELS = ("model_name", "engine")


class VllmNames(Collector):
    """The views above, for one scrape: `families` are the engine's (set before each),
    `histograms` and `requests` the routes' own."""

    def __init__(
        self,
        model_name: str,
        families: Callable[[], list[MetricFamily]],
        histograms: dict[str, Histogram],
        requests: Counter,
    ) -> None:
        self.labels = [model_name, "0"]
        self.families, self.histograms, self.requests = families, histograms, requests

    def collect(self) -> Iterator[Metric]:
        by_name = {f.name: f for f in self.families()}
        for name, kind, source in ENGINE_VIEWS:
            if source in by_name:
                yield self._one(name, kind, sum(v for _, v in by_name[source].samples))
        used, capacity = (
            _device(by_name.get(f"tierserve_kv_pages_{n}")) for n in ("used", "capacity")
        )
        if used is not None and capacity is not None:
            usage = used / capacity if capacity else 0.0
            yield self._one(
                "vllm:kv_cache_usage_perc",
                "gauge",
                usage,
                "KV-cache usage. 1 means 100 percent usage.",
            )
        yield from self._finished()
        for name, source in HISTOGRAM_VIEWS:
            yield from self._renamed(self.histograms[source], name)

    def _one(self, name: str, kind: str, value: float, doc: str = "") -> Metric:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(name, doc or f"vLLM's name for {name.removeprefix('vllm:')}", labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _finished(self) -> Iterator[Metric]:
        """vLLM's `request_success` by finished_reason: the requests that ended with one."""
        family = CounterMetricFamily(
            "vllm:request_success",
            "finished requests by reason",
            labels=[*LABELS, "finished_reason"],
        )
        for metric in self.requests.collect():
            for sample in metric.samples:
                reason = sample.labels.get("status")
                if sample.name.endswith("_total") and reason in ("stop", "length", "abort"):
                    family.add_metric([*self.labels, reason], sample.value)
        yield family

    def _renamed(self, histogram: Histogram, name: str) -> Iterator[Metric]:
        for metric in histogram.collect():
            view = Metric(name, f"vLLM's name for {metric.name}", "histogram")
            for sample in metric.samples:
                suffix = sample.name.removeprefix(metric.name)
                labels = {**dict(zip(LABELS, self.labels, strict=True)), **sample.labels}
                view.add_sample(name + suffix, labels, sample.value)
            yield view


def _device(family: MetricFamily | None) -> float | None:
    """A per-tier family's device sample (None: the family is not in this scrape)."""
    if family is None:
        return None
    return next((value for labels, value in family.samples if list(labels) == ["device"]), 0.0)
