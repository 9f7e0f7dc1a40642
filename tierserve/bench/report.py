"""Results folder of a benchmark: one JSON per run, a markdown report, PNG plots (matplotlib Agg).

<out>/runs/<name>.json      configuration, options, workload, summary and every request record
<out>/summary.json          every run's summary side by side, and the run's metadata
<out>/report.md             tables, ratios, the machine and the command
<out>/ttft_per_round.png    mean TTFT per round, one line per configuration
<out>/throughput.png        requests/s and tokens/s per configuration
<out>/hit_rate_by_tier.png  cache hit rate per configuration, split by tier

The plots are drawn by plots.py from the same summaries.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from tierserve.bench.client import RunResult
from tierserve.bench.metrics import later_rounds_ttft
from tierserve.bench.plots import plot
from tierserve.utils import cpu_field


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "os_cpu_count": os.cpu_count(),
    }
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        info["cpus_usable"] = os.cpu_count()
    for key, cmd in (("nproc", ["nproc"]), ("free_g", ["free", "-g"])):
        if shutil.which(cmd[0]):
            out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
            info[key] = out.strip("\n")
    if model := cpu_field("model name"):
        info["cpu_model"] = model
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_run_json(path: Path, run: dict[str, Any], result: RunResult) -> None:
    body = {
        **run,
        "url": result.url,
        "options": _jsonable(result.options),
        "workload": result.workload,
        "started_at": result.started_at,
        "server_metrics_before": result.server_metrics_before,
        "server_metrics_after": result.server_metrics_after,
    }
    # one request per line, times to the microsecond: the files stay small enough to commit
    records = ",\n".join(
        json.dumps(_rounded(r.to_dict()), separators=(",", ":")) for r in result.records
    )
    head = json.dumps(body, indent=1, allow_nan=False, default=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head[:-2]},\n "records": [\n{records}\n ]\n}}\n')


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats (a request rate of inf) as strings: JSON has no infinity."""
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()
    }


# --- markdown -----------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def _fill_passes(runs: list[dict[str, Any]]) -> list[str]:
    """Configurations with a shared store measure a second pass, once the store holds the
    workload: their first pass, while it filled, is the one comparable to a single pass."""
    filled = [r for r in runs if r.get("fill_pass")]
    if not filled:
        return []
    lines = [
        "Shared-store configurations: the first pass (the store filling as the workload runs, "
        "comparable to the other configurations' single pass), then the measured pass below "
        "(caches flushed, the store holding what the first pass wrote).",
        "",
        "| config | first pass hit rate | first pass req/s | measured hit rate |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in filled:
        f, s = r["fill_pass"], r["summary"]
        lines.append(
            f"| {r['name']} | {_pct(f['hit_rate'])} | {f['request_throughput']:.2f} | "
            f"{_pct(s['hit_rate'])} |"
        )
    return [*lines, ""]


def markdown(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# tierserve bench: {meta.get('title', 'results')}", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    if meta.get("command"):
        lines += ["Command:", "", "```", meta["command"], "```", ""]
    workload = meta.get("workload") or {}
    if workload:
        lines += ["## Workload", ""]
        lines += [f"- {k}: `{v}`" for k, v in workload.items()]
        lines += [""]
    if meta.get("sizing"):
        lines += ["## Server configurations", ""]
        lines += [f"- {k}: {v}" for k, v in meta["sizing"].items()]
        lines += [""]
        lines += ["| config | server flags |", "| --- | --- |"]
        lines += [f"| {r['name']} | `{' '.join(r.get('flags', []))}` |" for r in runs]
        lines += [""]

    lines += ["## Results", ""]
    lines += _fill_passes(runs)
    lines += [
        "| config | req/s | input tok/s | output tok/s | TTFT mean / p50 / p90 / p99 (s) | "
        "TPOT mean (ms) | ITL p50 / p99 (ms) | E2E mean / p99 (s) | hit rate | "
        "device / host hits | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        s = run["summary"]
        t, tp, itl, e = s["ttft_s"], s["tpot_s"], s["itl_s"], s["e2e_s"]
        tiers = (s.get("per_tier") or {}).get("hit_rate") or {}
        tier_txt = " / ".join(_pct(tiers.get(k)) for k in ("device", "host")) if tiers else "–"
        tpot_ms = None if tp["mean"] is None else tp["mean"] * 1e3
        itl50 = None if itl["median"] is None else itl["median"] * 1e3
        itl99 = None if itl["p99"] is None else itl["p99"] * 1e3
        lines.append(
            f"| {run['name']} | {s['request_throughput']:.2f} | {s['input_throughput']:.0f} | "
            f"{s['output_throughput']:.1f} | {_f(t['mean'])} / {_f(t['median'])} / "
            f"{_f(t['p90'])} / {_f(t['p99'])} | {_f(tpot_ms, '.1f')} | "
            f"{_f(itl50, '.1f')} / {_f(itl99, '.1f')} | {_f(e['mean'])} / {_f(e['p99'])} | "
            f"{_pct(s['hit_rate'])} | {tier_txt} | {s['failed']} |"
        )
    lines += [""]

    names = [r["name"] for r in runs]
    by_name = {r["name"]: r["summary"] for r in runs}
    baselines = [b for b in ("device-only", "limit") if b in by_name]
    if baselines and len(runs) > 1:
        lines += ["## Ratios", ""]
        head = "| config |"
        rule = "| --- |"
        for b in baselines:
            head += f" req/s vs {b} | TTFT mean vs {b} | TTFT rounds ≥ 1 vs {b} |"
            rule += " ---: | ---: | ---: |"
        lines += [head, rule]
        for name in names:
            s = by_name[name]
            row = f"| {name} |"
            for b in baselines:
                base = by_name[b]
                row += (
                    f" {_ratio(s['request_throughput'], base['request_throughput'])} |"
                    f" {_ratio(s['ttft_s']['mean'], base['ttft_s']['mean'])} |"
                    f" {_ratio(later_rounds_ttft(s), later_rounds_ttft(base))} |"
                )
            lines.append(row)
        lines += [
            "",
            "Throughput ratios above 1 and TTFT ratios below 1 are better than the baseline.",
            "",
        ]

    if any(len(r.get("repeats", ())) > 1 for r in runs):
        lines += _repeats(runs)
    rounds = sorted({p["round"] for r in runs for p in r["summary"]["per_round"]})
    if len(rounds) > 1:
        lines += ["## Per round: mean TTFT (s) and cache hit rate", ""]
        lines += ["| round | prompt tokens | " + " | ".join(names) + " |"]
        lines += ["| ---: | ---: |" + " ---: |" * len(names)]
        for k in rounds:
            cells, plen = [], None
            for run in runs:
                row = next((p for p in run["summary"]["per_round"] if p["round"] == k), None)
                if row is None:
                    cells.append("–")
                    continue
                plen = row["prompt_len_mean"]
                cells.append(f"{_f(row['ttft_s']['mean'])} ({_pct(row['hit_rate'])})")
            lines.append(f"| {k} | {_f(plen, '.0f')} | " + " | ".join(cells) + " |")
        lines += [""]

    tiered = [r for r in runs if r["summary"].get("per_tier")]
    if tiered:
        lines += ["## Cache traffic (server counters, measured run only)", ""]
        lines += [
            "| config | prompt tokens | cached on device | cached on host | loaded back | "
            "written to host | recomputed | preemptions (offload / recompute) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for run in tiered:
            pt = run["summary"]["per_tier"]
            c, pre = pt["cached_tokens"], pt["preemptions"]
            lines.append(
                f"| {run['name']} | {pt['prompt_tokens']:,.0f} | {c.get('device', 0):,.0f} | "
                f"{c.get('host', 0):,.0f} | {pt['load_back_tokens']:,.0f} | "
                f"{pt['host_written_tokens']:,.0f} | {pt['recomputed_tokens']:,.0f} | "
                f"{pre['offload']:,.0f} / {pre['recompute']:,.0f} |"
            )
        lines += [""]
        if any(
            r["summary"]["per_tier"]["load_back_tokens"]
            > r["summary"]["per_tier"]["cached_tokens"].get("host", 0)
            for r in tiered
        ):
            lines += [
                "Tier split as the server counts it; more tokens were loaded back than counted "
                "as host hits. The 'loaded back' column is the host tier's real traffic.",
                "",
            ]

    if meta.get("plots"):
        lines += ["## Plots", ""]
        lines += [f"![{p}]({p})" for p in meta["plots"]]
        lines += [""]
    machine = meta.get("machine")
    if machine:
        lines += ["## Machine", ""]
        for k, v in machine.items():
            if isinstance(v, str) and "\n" in v:
                lines += [f"- {k}:", "", "```", v, "```", ""]
            else:
                lines.append(f"- {k}: {v}")
        lines += [""]
    lines += [
        "Metrics: TTFT = first non-empty streamed chunk − send; TPOT = (E2E − TTFT)/(output "
        "tokens − 1) per request; ITL = every gap between chunks, pooled; throughput = completed "
        "/ (first send → last completion); hit rate = Σ cached / Σ prompt tokens. See "
        "docs/bench.md.",
        "",
    ]
    return "\n".join(lines)


def _repeats(runs: list[dict[str, Any]]) -> list[str]:
    n = max(len(r.get("repeats", ())) for r in runs)
    lines = [
        f"## Repeats ({n} per configuration, cache flushed before each)",
        "",
        "The tables above show each configuration's repeat of median request throughput "
        "(of an even count, the lower of the two middle ones). Here: median [min – max] over "
        "the repeats.",
        "",
        "| config | req/s | output tok/s | TTFT mean (s) | TTFT rounds ≥ 1 (s) | hit rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def spread(values: list[float | None], fmt: str) -> str:
        v = sorted(x for x in values if x is not None)
        if not v:
            return "–"
        med = float(np.median(v))
        return f"{med:{fmt}} [{v[0]:{fmt}} – {v[-1]:{fmt}}]"

    for run in runs:
        reps = run.get("repeats") or [{}]
        cells = [
            spread([r.get("request_throughput") for r in reps], ".2f"),
            spread([r.get("output_throughput") for r in reps], ".1f"),
            spread([r.get("ttft_mean_s") for r in reps], ".3f"),
            spread([r.get("ttft_later_rounds_mean_s") for r in reps], ".3f"),
            spread([r.get("hit_rate") for r in reps], ".3f"),
        ]
        lines.append(f"| {run['name']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def write_report(out: Path, runs: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """summary.json, the PNGs and report.md in `out`; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "plots": plot(runs, out)}
    summary = {"meta": meta, "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    path = out / "report.md"
    path.write_text(markdown(runs, meta))
    return path
