"""What each SGLang release does with a host cache that the node cannot hold (`--check-sglang
--sglang-version V`).

- Before v0.5.19 every rank checks its own host pool against available RAM − 10 GiB, alone:
  ranks that allocate together can exhaust the node while each passed (the seed's 8 × 300 GB
  hang on a 449 GB node).
- v0.5.19 (PR #35540, merged 2026-08-19): a rank's budget is (available − 10 GiB) // ranks per
  host (world size // nnodes), and a pool above it raises a ValueError at start-up: SGLang
  refuses instead of hanging. Open bug #38156: each rank reads `available` when it reaches the
  guard, after peers may have pinned their pools, yet still divides by every rank, so the guard
  can refuse pools that fit when several ranks share a host.
- v0.5.21 (PR #40135, merged 2026-09-19): with neither `--hicache-size` nor `--hicache-ratio`,
  `--hicache-host-memory-fraction` (default 0.8) sizes the pools: the default ratio (2) is
  lowered until a rank's pool fits 95% of fraction × its budget. SGLang shrinks the host cache.

The release that first carries each PR was read from SGLang's release branches and tags (v0.5.18
was cut before #35540 merged, v0.5.19 after; v0.5.20 was tagged the day before #40135 merged).
NEWEST is the newest release this project knows; `--sglang-version` defaults to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierserve.errors import TierserveError
from tierserve.utils import GiB, format_gb

NEWEST = "0.5.21"
SPLIT_BUDGET = (0, 5, 19)  # PR #35540
AUTO_SIZE = (0, 5, 21)  # PR #40135
SGLANG_HOST_RESERVE = 10 * GiB  # SGLang's reserve, taken from available RAM before any check
DEFAULT_FRACTION = 0.8  # --hicache-host-memory-fraction
AUTO_SIZE_HEADROOM = 0.95  # the fitted pools fill at most this much of their share
DEFAULT_RATIO = 2.0


@dataclass(frozen=True, order=True)
class SGLangVersion:
    parts: tuple[int, int, int]

    @classmethod
    def parse(cls, text: str) -> SGLangVersion:
        """ "0.5.19", "v0.5.19", "0.5.19.post1", "0.5.22.dev20261009" → (0, 5, 19) …"""
        match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:[.\-+]?\w*)*", text.strip())
        if match is None:
            message = f"--sglang-version {text!r} is not a version like 0.5.21"
            raise TierserveError(message, "sglang_version")
        major, minor, patch = (int(g) for g in match.groups())
        return cls((major, minor, patch))

    def __str__(self) -> str:
        return "v" + ".".join(map(str, self.parts))

    @property
    def splits_budget(self) -> bool:
        return self.parts >= SPLIT_BUDGET

    @property
    def auto_sizes(self) -> bool:
        return self.parts >= AUTO_SIZE


def rank_budget(available: int, ranks: int) -> int:
    """SGLang's own per-rank host budget since v0.5.19."""
    return max(0, available - SGLANG_HOST_RESERVE) // max(1, ranks)


def auto_ratio(device_bytes: int, available: int, ranks: int, fraction: float) -> float:
    """The ratio SGLang (v0.5.21+) picks when it sizes the host pools itself."""
    budget = int(rank_budget(available, ranks) * fraction)
    return min(DEFAULT_RATIO, budget * AUTO_SIZE_HEADROOM / max(1, device_bytes))


def own_check_line(version: SGLangVersion, per_rank: int, available: int, ranks: int) -> str:
    """What SGLang `version` itself does with a host pool of `per_rank` bytes on each of
    `ranks` ranks of a node with `available` bytes free: hang, refuse, or start."""
    if not version.splits_budget:
        test = f"{format_gb(per_rank)} ≤ {format_gb(available)} − {SGLANG_HOST_RESERVE // GiB} GiB"
        if per_rank > available - SGLANG_HOST_RESERVE:
            return f"SGLang {version}: its per-rank check fails ({test} is false): it refuses"
        return (
            f"SGLang {version}: its own check passes ({test}) because each rank checks alone: "
            "ranks that allocate together exhaust the node's RAM (the server hangs or is "
            "OOM-killed); v0.5.19 and later refuse at start-up instead"
        )
    budget = rank_budget(available, ranks)
    reserve = SGLANG_HOST_RESERVE // GiB
    test = (
        f"{format_gb(per_rank)} per rank vs ({format_gb(available)} − {reserve} GiB)"
        f" // {ranks} ranks = {format_gb(budget)}"
    )
    if per_rank > budget:
        return f"SGLang {version} refuses at start-up (ValueError: not enough host memory): {test}"
    line = f"SGLang {version}'s own check passes: {test}"
    if ranks > 1:
        line += (
            "; but open bug #38156: a rank that reaches the guard after others pinned their "
            "pools sees less available RAM and can be refused although the pools fit"
        )
    return line
