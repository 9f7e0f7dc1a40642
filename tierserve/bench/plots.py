"""The PNG plots of a results folder (matplotlib Agg), drawn from the runs' summaries: mean TTFT
per round, throughput per configuration, cache hit rate per tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError

PLOTS = ("ttft_per_round.png", "throughput.png", "hit_rate_by_tier.png")


def plot(runs: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        raise TierserveError(
            "plots need matplotlib: pip install 'tierserve[bench]' (make installs it)", "out"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [r["name"] for r in runs]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    # TTFT per round
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for i, run in enumerate(runs):
        pr = run["summary"]["per_round"]
        xs = [p["round"] for p in pr]
        ys = [p["ttft_s"]["mean"] or 0.0 for p in pr]
        if len(xs) == 1:
            ax.bar(i, ys[0], color=colors[i % len(colors)], label=run["name"])
        else:
            ax.plot(xs, ys, marker="o", color=colors[i % len(colors)], label=run["name"])
    if all(len(r["summary"]["per_round"]) <= 1 for r in runs):
        ax.set_xticks(range(len(runs)), names, rotation=15)
        ax.set_xlabel("configuration")
    else:
        ax.set_xlabel("round")
        locator = ax.xaxis.get_major_locator()
        if isinstance(locator, MaxNLocator):  # a numeric axis's AutoLocator
            locator.set_params(integer=True)
    ax.set_ylabel("mean TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Time to first token per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS[0])
    plt.close(fig)
    written.append(PLOTS[0])

    # throughput
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.2), dpi=120)
    x = list(range(len(runs)))
    panels = (
        ("request_throughput", "Requests / s", "%.2f"),
        ("input_throughput", "Input tokens / s", "%.0f"),
        ("output_throughput", "Output tokens / s", "%.1f"),
    )
    for ax, (key, title, fmt) in zip(axes, panels, strict=True):
        bars = ax.bar(x, [r["summary"][key] for r in runs], color=colors[: len(runs)])
        ax.bar_label(bars, fmt=fmt, fontsize=8)
        ax.set_title(title)
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / PLOTS[1])
    plt.close(fig)
    written.append(PLOTS[1])

    # hit rate by tier
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    bottoms = [0.0] * len(runs)
    for tier, color in (("device", colors[0]), ("host", colors[1])):
        vals = []
        for r in runs:
            pt = r["summary"].get("per_tier")
            if pt:
                vals.append(pt["hit_rate"].get(tier) or 0.0)
            else:  # no tier counters: the overall rate, shown as device
                vals.append((r["summary"]["hit_rate"] or 0.0) if tier == "device" else 0.0)
        ax.bar(x, vals, bottom=bottoms, color=color, label=f"{tier} tier")
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for i, b in enumerate(bottoms):
        ax.text(i, b + 0.035, f"{b:.0%}", ha="center", fontsize=8)
    loaded = [
        (i, pt["load_back_tokens"] / pt["prompt_tokens"])
        for i, r in enumerate(runs)
        if (pt := r["summary"].get("per_tier")) and pt["prompt_tokens"] and pt["load_back_tokens"]
    ]
    if loaded:
        ax.scatter(
            [i for i, _ in loaded],
            [v for _, v in loaded],
            marker="D",
            color="black",
            zorder=3,
            label="loaded back from host / prompt tokens",
        )
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Cache hit rate by tier")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / PLOTS[2])
    plt.close(fig)
    written.append(PLOTS[2])
    return written
