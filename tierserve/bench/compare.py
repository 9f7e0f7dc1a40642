"""Side-by-side runs: start `tierserve serve` under named configurations one after the other, run
the same workload against each, and write a results folder (see report.py).

Configurations (the device pool of the small ones holds about a quarter of the workload's KV):

    device-only               the small device pool, no host tier
    write_through             the small pool + a host tier, --hicache-write-policy write_through
    write_through_selective   ... write_through_selective
    write_back                ... write_back
    limit                     a device pool big enough for the whole workload (the upper bound)
    replicas-N-POLICY[-store] N servers with limit's pool behind sglang-router --policy POLICY
                              (round_robin, cache_aware, random, power_of_two), with -store one
                              Mooncake Store shared by all (replicas.py); a -store layout runs
                              the workload once to fill the store, waits for the writes to land,
                              then measures (caches flushed, the store kept)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierserve.args import check_mem_fraction
from tierserve.bench import report
from tierserve.bench.client import LoadOptions, RunResult, run_load, warmup
from tierserve.bench.metrics import later_rounds_ttft, summarize
from tierserve.bench.replicas import ReplicaLayout, ReplicaSet
from tierserve.bench.server_process import ServerProcess
from tierserve.bench.workloads import TokenSpace, Workload
from tierserve.errors import TierserveError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
CONFIG_NAMES = ("device-only", *WRITE_POLICIES, "limit")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    flags: list[str]
    description: str
    replicas: ReplicaLayout | None = None  # servers behind a router, not one server
    store_extra: dict[str, Any] | None = None  # tier keys for a shared store (replicas)


@dataclass(frozen=True)
class Sizing:
    kv_tokens: int  # the whole workload's KV, shared prefixes once
    device_tokens: int  # device pool of the small configurations
    host_ratio: float  # host tier = this × device pool
    limit_tokens: int  # device pool of "limit"
    page_size: int

    def describe(self) -> dict[str, str]:
        host = int(self.device_tokens * self.host_ratio)
        return {
            "workload KV (shared prefixes once)": f"{self.kv_tokens:,} tokens",
            "small device pool (device-only, write policies)": (
                f"{self.device_tokens:,} tokens ({self.device_tokens / self.kv_tokens:.0%} of "
                "the workload's KV)"
            ),
            "host tier (write policies)": f"{host:,} tokens (--hicache-ratio {self.host_ratio:g})",
            "limit device pool": f"{self.limit_tokens:,} tokens",
            "page size": f"{self.page_size} tokens",
        }


def _round_up(n: float, page: int) -> int:
    return int(math.ceil(n / page) * page)


def size_pools(
    workload: Workload,
    page_size: int,
    device_tokens: int | None = None,
    fraction: float = 0.25,
    host_ratio: float | None = None,
) -> Sizing:
    """The small pool holds `fraction` of the workload's KV (never less than its longest request
    plus two pages); the host tier holds the whole workload twice over; "limit" holds it twice
    over, plus a page per request for partly filled pages."""
    check_mem_fraction(fraction, "device_fraction", "--", "device-fraction", one_allowed=True)
    kv = workload.kv_tokens()
    floor = workload.max_request_tokens() + 2 * page_size
    small = _round_up(device_tokens or max(kv * fraction, floor), page_size)
    if small < floor:
        raise TierserveError(
            f"device pool {small} tokens cannot hold the longest request ({floor - 2 * page_size} "
            "tokens) plus two pages",
            "device_tokens",
        )
    ratio = host_ratio or max(2.0, float(math.ceil(2 * kv / small)))
    limit = _round_up(2 * kv + workload.num_requests * page_size, page_size)
    return Sizing(kv, small, ratio, limit, page_size)


def configurations(
    sizing: Sizing,
    names: Sequence[str] = CONFIG_NAMES,
    store_extra: dict[str, Any] | None = None,
) -> list[ServerConfig]:
    small = ["--max-total-tokens", str(sizing.device_tokens)]
    page = ["--page-size", str(sizing.page_size)]
    out = []
    for name in names:
        if name == "device-only":
            out.append(ServerConfig(name, small + page, "small device pool, no host tier"))
        elif name in WRITE_POLICIES:
            flags = small + page + ["--enable-hierarchical-cache"]
            flags += ["--hicache-ratio", f"{sizing.host_ratio:g}"]
            flags += ["--hicache-write-policy", name]
            out.append(ServerConfig(name, flags, f"small device pool + host tier, {name}"))
        elif name == "limit":
            flags = ["--max-total-tokens", str(sizing.limit_tokens)] + page
            out.append(ServerConfig(name, flags, "device pool big enough for everything"))
        elif (layout := ReplicaLayout.parse(name)) is not None:
            flags = ["--max-total-tokens", str(sizing.limit_tokens)] + page
            out.append(ServerConfig(name, flags, layout.describe(), layout, store_extra))
        else:
            known = ", ".join(CONFIG_NAMES)
            raise TierserveError(
                f"unknown configuration {name!r}; known: {known}, replicas-N-POLICY[-store]",
                "configs",
            )
    return out


# --- the whole comparison -----------------------------------------------------------------


def warmup_prompts(space: TokenSpace, n: int = 2, length: int = 48) -> list[list[int]]:
    rng = np.random.default_rng(12345)
    return [space.draw(rng, length) for _ in range(n)]


def run_repeats(
    url: str,
    workload: Workload,
    opts: LoadOptions,
    space: TokenSpace,
    repeats: int = 1,
    warmup_requests: int = 2,
) -> list[tuple[RunResult, dict[str, Any]]]:
    """Warm up once, then run the workload `repeats` times (the cache flushed before each)."""
    if warmup_requests:
        warmup(url, opts, warmup_prompts(space, warmup_requests))
    out = []
    for _ in range(repeats):
        result = run_load(url, workload, opts)
        out.append((result, summarize(result)))
    return out


def _run_config(
    model: str,
    cfg: ServerConfig,
    flags: list[str],
    logs: Path,
    workload: Workload,
    opts: LoadOptions,
    space: TokenSpace,
    repeats: int,
    warmup_requests: int,
    log: Any,
) -> tuple[list[tuple[RunResult, dict[str, Any]]], dict[str, Any] | None]:
    """The measured repeats, and a shared store's fill pass (None without one)."""
    if cfg.replicas is None:
        with ServerProcess(model, flags, logs / f"{cfg.name}.log") as server:
            reps = run_repeats(server.url, workload, opts, space, repeats, warmup_requests)
            return reps, None
    fill = None
    with ReplicaSet(model, cfg.replicas, flags, logs, cfg.name, cfg.store_extra) as replicas:
        if cfg.replicas.shared_store:
            fill = summarize(run_load(replicas.url, workload, opts))
            log(f"[{cfg.name}] filling the store: hit rate {fill['hit_rate'] or 0:.1%}")
            if not replicas.drain_writes():
                log(f"[{cfg.name}] the replicas' store writes did not drain in time")
        reps = run_repeats(replicas.url, workload, opts, space, repeats, warmup_requests)
    return reps, fill


def brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "ttft_mean_s": summary["ttft_s"]["mean"],
        "ttft_later_rounds_mean_s": later_rounds_ttft(summary),
        "hit_rate": summary["hit_rate"],
    }


def compare(
    model: str,
    workload: Workload,
    opts: LoadOptions,
    configs: Sequence[ServerConfig],
    out: Path,
    space: TokenSpace,
    server_args: Sequence[str] = (),
    meta: dict[str, Any] | None = None,
    log: Any = print,
    repeats: int = 1,
    warmup_requests: int = 2,
) -> Path:
    """Run `workload` against a fresh server per configuration; write the results folder."""
    if opts.backend != "generate":
        raise TierserveError("compare starts tierserve servers: use --backend generate", "backend")
    if repeats < 1:
        raise TierserveError(f"repeats must be >= 1, got {repeats}", "repeats")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for cfg in configs:
        flags = [*cfg.flags, *server_args]
        log(f"[{cfg.name}] starting: tierserve serve {' '.join(flags)}")
        start = time.monotonic()
        reps, fill = _run_config(model, cfg, flags, out / "logs", workload, opts, space,
                                 repeats, warmup_requests, log)  # fmt: skip
        # the repeat of median request throughput (the lower one of an even count) stands for
        # the configuration; every repeat's headline numbers are kept beside it
        order = sorted(range(repeats), key=lambda i: reps[i][1]["request_throughput"])
        mid = order[(repeats - 1) // 2]
        result, summary = reps[mid]
        run = {
            "name": cfg.name,
            "description": cfg.description,
            "flags": flags,
            "summary": summary,
            "repeat_shown": mid,
            "repeats": [brief(s) for _, s in reps],
        }
        if fill is not None:  # a shared store's first pass, while it filled
            run["fill_pass"] = brief(fill)
        report.write_run_json(out / "runs" / f"{cfg.name}.json", run, result)
        for i, (res_i, sum_i) in enumerate(reps):
            if i != mid:
                other = {**run, "summary": sum_i, "repeat_shown": i}
                report.write_run_json(out / "runs" / f"{cfg.name}.repeat{i}.json", other, res_i)
        runs.append(run)
        for i, (_, s) in enumerate(reps):
            log(
                f"[{cfg.name}] repeat {i}: {s['completed']} requests in {s['duration_s']:.1f} s: "
                f"{s['request_throughput']:.2f} req/s, TTFT mean {s['ttft_s']['mean'] or 0:.3f} s, "
                f"hit rate {s['hit_rate'] or 0:.1%}"
            )
            if s["failed"]:
                log(f"[{cfg.name}] {s['failed']} failed: {s['errors']}")
        log(f"[{cfg.name}] wall {time.monotonic() - start:.0f} s with startup")
    shown: dict[str, Any] = {"model": model, **(meta or {})}
    shown.setdefault("machine", report.machine_info())
    shown = json.loads(json.dumps(shown, default=str))
    return report.write_report(out, runs, shown)
