"""The engine's Prometheus families, read from its own state between steps (the core answers
`GetMetrics` with them; the server renders them unchanged, so the numbers can never drift from
the engine's own). Names and meanings: docs/server.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tierserve.core_messages import MetricFamily

if TYPE_CHECKING:
    from tierserve.engine.dp_groups import AttentionGroups
    from tierserve.engine.engine import Engine
    from tierserve.speculative import SpecStats
    from tierserve.storage import StorageTier


def _gauge(name: str, doc: str, value: float) -> MetricFamily:
    return MetricFamily(name, "gauge", doc, [], [([], float(value))])


def _counter(name: str, doc: str, value: float) -> MetricFamily:
    return MetricFamily(name, "counter", doc, [], [([], float(value))])


def _labelled(
    name: str, kind: str, doc: str, label: str, values: Mapping[str, float]
) -> MetricFamily:
    samples = [([key], float(value)) for key, value in values.items()]
    return MetricFamily(name, kind, doc, [label], samples)


def engine_metrics(engine: Engine) -> list[MetricFamily]:
    sched = engine.scheduler
    stats = sched.stats
    offload = stats.num_offload_preemptions
    families = [
        _gauge(
            "tierserve_num_requests_running", "requests being decoded or prefilled",
            len(sched.running),
        ),
        _gauge("tierserve_num_requests_waiting", "requests queued", len(sched.waiting)),
        _gauge(
            "tierserve_peak_requests_running",
            "the most requests running at once in one step since the start, on the node",
            engine.peak_running,
        ),
        _counter("tierserve_prompt_tokens", "prompt tokens admitted", stats.num_prompt_tokens),
        _counter("tierserve_generation_tokens", "tokens generated", stats.num_generated_tokens),
        _counter("tierserve_engine_steps", "batches the engine ran", stats.num_steps),
        _counter(
            "tierserve_recomputed_tokens", "tokens computed again after preemption",
            stats.num_recomputed_tokens,
        ),
        _labelled(
            "tierserve_preemptions", "counter", "preempted requests", "kind",
            {"offload": offload, "recompute": stats.num_preemptions - offload},
        ),
    ]  # fmt: skip
    families += _tiers(engine)
    families += _memory(engine)
    if engine.args.speculative_algorithm is not None:
        families += _speculation(engine.spec_stats)
    if engine.groups is not None:
        families += _groups(engine.groups)
    writer = engine.capture.writer
    if writer is not None:
        outcomes = {"written": writer.written, "failed": writer.failed}
        doc = "hidden-state files by outcome"
        families.append(
            _labelled("tierserve_hidden_states_files", "counter", doc, "outcome", outcomes)
        )
        doc = "locks of whole hidden-state files that no reader took, removed (hidden_states.py)"
        expired = writer.locks_expired
        families.append(_counter("tierserve_hidden_states_locks_expired", doc, expired))
    if engine.storage is not None:
        families += _storage(engine.storage)
    return families


def _speculation(stats: SpecStats) -> list[MetricFamily]:
    """vLLM's spec_decode counters under tierserve's prefix (docs/speculative.md)."""
    per_pos = {str(i): n for i, n in enumerate(stats.accepted_per_position)}
    return [
        _counter("tierserve_spec_decode_num_drafts", "verify steps of a request with a draft",
                 stats.num_drafts),
        _counter("tierserve_spec_decode_num_draft_tokens", "tokens drafted",
                 stats.num_draft_tokens),
        _counter("tierserve_spec_decode_num_accepted_tokens", "drafted tokens the target kept",
                 stats.num_accepted_tokens),
        _labelled("tierserve_spec_decode_num_accepted_tokens_per_pos", "counter",
                  "drafted tokens kept, by their place in the draft (0: the first)", "position",
                  per_pos),
    ]  # fmt: skip


def _groups(groups: AttentionGroups) -> list[MetricFamily]:
    """Data-parallel attention: each attention group as it reported after the last step (the
    families above without a dp_rank label are rank 0's group), and the node's peak."""
    reports = groups.reports

    def per_group(name: str, doc: str, values: list[int]) -> MetricFamily:
        return _labelled(name, "gauge", doc, "dp_rank", {str(g): v for g, v in enumerate(values)})

    return [
        per_group(
            "tierserve_dp_requests_running", "requests running in each attention group",
            [g.running for g in reports],
        ),
        per_group(
            "tierserve_dp_requests_waiting", "requests queued in each attention group",
            [g.waiting for g in reports],
        ),
        per_group(
            "tierserve_dp_device_tokens_used", "device pool tokens in use, per attention group",
            [g.device_tokens_used for g in reports],
        ),
        _labelled(
            "tierserve_dp_requests_placed", "counter", "requests rank 0 placed on each group",
            "dp_rank", {str(g): v for g, v in enumerate(groups.dispatcher.placed)},
        ),
        _labelled(
            "tierserve_dp_idle_steps", "counter",
            "steps a group joined with nothing to run (the others' MLP collectives need it)",
            "dp_rank", {str(g): v for g, v in enumerate(groups.idle_steps)},
        ),
        _gauge("tierserve_dp_size", "attention groups (data-parallel attention)", len(reports)),
        _gauge(
            "tierserve_node_requests_running", "requests running in all attention groups",
            groups.running,
        ),
    ]  # fmt: skip


def _memory(engine: Engine) -> list[MetricFamily]:
    """KV bytes allocated, per rank and per node. Every rank holds its own device pool; a host
    copy shared by a group of ranks counts once on the node, and a rank's share of it is its
    part. Page and token counts elsewhere are per rank (the ranks' trees are the same), so they
    need no node figure."""
    plan, args = engine.kv_plan, engine.args
    samples = [
        (["device", "rank"], float(plan.device_bytes)),
        (["device", "node"], float(plan.device_bytes * args.local_ranks)),
    ]
    if plan.host is not None:
        samples.append((["host", "rank"], float(plan.host.bytes_per_rank)))
        samples.append((["host", "node"], float(plan.host.bytes_per_node)))
    sharing = plan.host.sharing if plan.host is not None else 1
    return [
        MetricFamily(
            "tierserve_kv_bytes", "gauge", "KV memory allocated", ["tier", "scope"], samples
        ),
        _gauge("tierserve_tp_size", "tensor-parallel ranks", args.tp_size),
        _gauge("tierserve_local_ranks", "ranks on this node", args.local_ranks),
        _gauge(
            "tierserve_host_copy_sharing", "ranks that share one host copy of their KV", sharing
        ),
    ]


def _tiers(engine: Engine) -> list[MetricFamily]:
    kv = engine.kv
    host = kv.host
    used = {"device": kv.num_pages - kv.allocator.num_free}
    total = {"device": kv.num_pages}
    cached = {"device": kv.cached_pages()}
    if host is None:
        hits = {"device": engine.scheduler.stats.num_cached_tokens}
    else:
        used["host"] = host.used_pages
        total["host"] = host.host_pool.num_pages
        cached["host"] = kv.radix.host_pages if kv.radix else 0
        hits = {"device": host.stats.device_hit_tokens, "host": host.stats.host_hit_tokens}
    families = [
        _labelled("tierserve_kv_pages_used", "gauge", "pages in use", "tier", used),
        _labelled("tierserve_kv_pages_capacity", "gauge", "pages in the pool", "tier", total),
        _labelled(
            "tierserve_radix_cached_pages", "gauge", "pages the radix cache holds", "tier", cached
        ),
        _labelled(
            "tierserve_cached_tokens", "counter", "prompt tokens served from cache", "tier", hits
        ),
    ]
    if host is None:
        return families
    s = host.stats
    evicted = {"device": s.device_evicted_tokens, "host": s.host_evicted_tokens}
    return families + [
        _counter(
            "tierserve_host_written_tokens", "tokens copied to the host tier", s.host_written_tokens
        ),
        _counter(
            "tierserve_load_back_tokens", "tokens loaded back from the host", s.load_back_tokens
        ),
        _counter("tierserve_load_back_bytes", "bytes loaded back from the host", s.load_back_bytes),
        _counter("tierserve_load_back_seconds", "time spent loading back", s.load_back_seconds),
        _labelled("tierserve_evicted_tokens", "counter", "tokens evicted", "tier", evicted),
        _counter("tierserve_backup_bytes", "bytes copied to the host tier", s.backup_bytes),
        _gauge("tierserve_copies_in_flight", "tier copies issued, not landed", host.in_flight),
        _counter(
            "tierserve_deferred_evictions",
            "device evictions deferred because a copy of the node was in flight",
            kv.radix.deferred_evictions if kv.radix else 0,
        ),
        _counter(
            "tierserve_copy_waits",
            "times device pages were needed before copies landed",
            s.forced_waits,
        ),
    ]


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
    ("dropped_writes", "pages not written: queue full, store unavailable or full"),
    ("breaker_opens", "times the circuit breaker opened"),
    ("breaker_skips", "storage calls skipped while the breaker was open"),
)


def _storage(storage: StorageTier) -> list[MetricFamily]:
    stats = storage.stats.as_dict()
    families = [
        _counter(f"tierserve_storage_{field}", doc, stats[field]) for field, doc in STORAGE_COUNTERS
    ]
    families.append(
        _gauge(
            "tierserve_storage_write_queue_pages", "pages queued for storage, not written yet",
            storage.queued_writes,
        )
    )  # fmt: skip
    state = {name: float(storage.store.state == name) for name in ("closed", "open", "half-open")}
    families.append(
        _labelled(
            "tierserve_storage_breaker", "gauge", "circuit breaker state (1 = current)", "state",
            state,
        )
    )  # fmt: skip
    return families
