"""The field's serving metrics, computed from the client's per-request timelines.

    TTFT        first non-empty streamed chunk − send
    ITL         every gap between consecutive non-empty chunks, pooled over all requests
    TPOT        (E2E − TTFT) / (output tokens − 1), per request (requests of ≥ 2 tokens)
    E2E         end of the stream − send
    throughput  completed requests / (first send → last completion); input and output tokens/s
                over the same span (input = prompt tokens the server reports, else those sent)
    hit rate    Σ cached tokens / Σ prompt tokens: overall and per round from the usage the
                server reports; per tier from its counters (tierserve only):
                Δ tierserve_cached_tokens_total{tier} / Δ tierserve_prompt_tokens_total

Each distribution is reported as mean, median, p90 and p99 (numpy's linear interpolation, as
vLLM's and SGLang's benchmark scripts use).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from tierserve.bench.client import RequestRecord, RunResult


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99]).tolist()
    return {"count": int(v.size), "mean": float(v.mean()), "median": p50, "p90": p90, "p99": p99}


def ttft(rec: RequestRecord) -> float:
    assert rec.first is not None
    return rec.first - rec.send


def e2e(rec: RequestRecord) -> float:
    assert rec.end is not None
    return rec.end - rec.send


def tpot(rec: RequestRecord) -> float | None:
    if rec.output_tokens < 2:
        return None
    return (e2e(rec) - ttft(rec)) / (rec.output_tokens - 1)


def itls(rec: RequestRecord) -> list[float]:
    t = rec.chunk_times
    return [b - a for a, b in itertools.pairwise(t)]


def hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """Σ cached / Σ prompt over the requests whose server reported cached tokens."""
    cached = prompt = 0
    for r in records:
        if r.cached_tokens is None:
            continue
        cached += r.cached_tokens
        prompt += r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
    return cached / prompt if prompt else None


def tier_hit_rates(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any] | None:
    """Per-tier hit rates and cache traffic from two scrapes of a tierserve server's /metrics."""
    if not before or not after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = delta("tierserve_prompt_tokens_total")
    tiers = sorted(
        k.split("tier=")[1].rstrip("}")
        for k in after
        if k.startswith("tierserve_cached_tokens_total{")
    )
    cached = {t: delta(f"tierserve_cached_tokens_total{{tier={t}}}") for t in tiers}
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": {t: (c / prompt if prompt else None) for t, c in cached.items()},
        "load_back_tokens": delta("tierserve_load_back_tokens_total"),
        "host_written_tokens": delta("tierserve_host_written_tokens_total"),
        "recomputed_tokens": delta("tierserve_recomputed_tokens_total"),
        "preemptions": {
            kind: delta(f"tierserve_preemptions_total{{kind={kind}}}")
            for kind in ("offload", "recompute")
        },
    }
    return out


def summarize(result: RunResult) -> dict[str, Any]:
    done = [r for r in result.records if r.ok]
    failed = len(result.records) - len(done)
    span = 0.0
    if done:
        ends = [r.end for r in done if r.end is not None]  # every one: `ok` has an end
        span = max(ends) - min(r.send for r in result.records)
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done
    )
    output_tokens = sum(r.output_tokens for r in done)
    rounds = sorted({r.round for r in done})
    per_round = []
    for k in rounds:
        in_round = [r for r in done if r.round == k]
        per_round.append(
            {
                "round": k,
                "requests": len(in_round),
                "prompt_len_mean": float(np.mean([r.prompt_len for r in in_round])),
                "hit_rate": hit_rate(in_round),
                "ttft_s": distribution(ttft(r) for r in in_round),
                "e2e_s": distribution(e2e(r) for r in in_round),
            }
        )
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    return {
        "completed": len(done),
        "failed": failed,
        "errors": sorted({r.error for r in result.records if r.error})[:5],
        "duration_s": span,
        "request_throughput": len(done) / span if span else 0.0,
        "input_throughput": input_tokens / span if span else 0.0,
        "output_throughput": output_tokens / span if span else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "ttft_s": distribution(ttft(r) for r in done),
        "tpot_s": distribution(tpots),
        "itl_s": distribution(x for r in done for x in itls(r)),
        "e2e_s": distribution(e2e(r) for r in done),
        "hit_rate": hit_rate(done),
        "per_round": per_round,
        "per_tier": tier_hit_rates(result.server_metrics_before, result.server_metrics_after),
    }


def later_rounds_ttft(summary: dict[str, Any]) -> float | None:
    """Mean TTFT over rounds ≥ 1, weighted by requests (None for single-round workloads)."""
    num = den = 0.0
    for r in summary["per_round"]:
        if r["round"] >= 1 and r["ttft_s"]["mean"] is not None:
            num += r["ttft_s"]["mean"] * r["requests"]
            den += r["requests"]
    return num / den if den else None
