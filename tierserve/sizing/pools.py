"""Pool sizes, the arithmetic `tierserve plan` and `tierserve serve` both call: a rank's
weights, its device pool, and the host cache a node's RAM holds for its ranks.

Pure functions over frozen dataclasses: no printing, no psutil, no files. Every size is an int of
bytes. A *rank* is one tensor-parallel process (one GPU); every rank of a TP group holds the same
tokens, each its own share of their KV, so a token count "per rank" is also the count for the
whole model instance. A *node* is one machine: its ranks share its host RAM, which is where
per-rank host caches add up.

- device pool per rank = GPU memory × mem_fraction_static − memory already in use − weights.
- host cache per rank, at most = (available − overhead − margin) // local ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tierserve.args import check_mem_fraction
from tierserve.errors import TierserveError
from tierserve.utils import GB, GiB, format_gb, parse_size

# Host RAM one serving process needs beyond its KV cache (CUDA context, torch, pinned staging,
# tokenizer); the seed's 8-rank server took ~40 GB, i.e. ~5 GB a rank.
DEFAULT_OVERHEAD_PER_RANK = 5 * GB
# Kept free for the OS and page cache; equal to SGLang's own per-rank reserve, so that the last
# SGLang rank to allocate still passes its check.
DEFAULT_MARGIN = 10 * GiB


# ---------------------------------------------------------------------------------------------
# Device pool


def weights_per_rank(total_weight_bytes: int, tp: int) -> int:
    # TP splits every large matrix (attention, MLP, experts, vocabulary); norms are replicated,
    # but at a few MB they do not matter here.
    return math.ceil(total_weight_bytes / tp)


def device_pool_bytes(
    gpu_total: int, gpu_free: int, rank_weights: int, mem_fraction_static: float
) -> int:
    """KV pool of one rank = GPU memory × mem_fraction_static − memory already in use − the
    weights on that rank.

    This is SGLang's rule, and tierserve's: the static fraction holds weights and the KV pool,
    while activations, CUDA graphs and NCCL buffers live in the remaining (1 − fraction). What is
    in use before the engine loads (another process, the CUDA context) counts against the
    fraction: `serve` reads it from the card, `plan` assumes a card with nothing on it (free ==
    total), so a measured pool comes out smaller by that much.
    """
    check_mem_fraction(mem_fraction_static)
    in_use = gpu_total - gpu_free
    return max(0, int(gpu_total * mem_fraction_static) - in_use - rank_weights)


def tokens_in(pool_bytes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Whole pages of tokens that fit in `pool_bytes`."""
    tokens = pool_bytes // bytes_per_token
    return tokens - tokens % page_size


def local_ranks(processes: int, gpus_per_node: int) -> int:
    """Processes sharing one node's host RAM: a node's worth when they span nodes. Data-parallel
    replicas are counted only when asked for (--dp), never assumed to fill spare GPUs."""
    return min(processes, gpus_per_node)


# ---------------------------------------------------------------------------------------------
# Host cache

HostMode = Literal["auto", "ratio", "per_rank", "per_node", "off"]


@dataclass(frozen=True)
class HostRequest:
    """How the host cache is asked for: the four ways SGLang/vLLM/tierserve users say it."""

    mode: HostMode = "auto"
    ratio: float = 0.0  # mode "ratio": host tokens = device tokens × ratio
    size: int = 0  # bytes; per rank or per node as `mode` says

    def __post_init__(self) -> None:
        if not 0 <= self.ratio < 1e6:  # NaN fails this too
            raise TierserveError(f"host ratio must be in [0, 1e6), got {self.ratio}", "host_ratio")
        if self.size < 0:
            raise TierserveError("host cache size must not be negative", "host_cache")

    @classmethod
    def auto(cls) -> HostRequest:
        return cls("auto")

    @classmethod
    def of_ratio(cls, ratio: float) -> HostRequest:
        return cls("ratio", ratio=ratio)

    @classmethod
    def per_rank(cls, size: int) -> HostRequest:
        return cls("per_rank", size=size)

    @classmethod
    def per_node(cls, size: int) -> HostRequest:
        return cls("per_node", size=size)

    def describe(self) -> str:
        return {
            "auto": "auto: the largest that fits",
            "ratio": f"{self.ratio:g} × the device pool",
            "per_rank": f"{format_gb(self.size)} per rank",
            "per_node": f"{format_gb(self.size)} per node",
            "off": "off",
        }[self.mode]


@dataclass(frozen=True)
class HostBudget:
    """One node's host RAM as the host caches of its ranks may use it."""

    available: int  # free now (psutil's `available`), before the server starts
    overhead: int  # what the server's processes will take besides the KV cache
    margin: int  # kept free for the OS and everything else
    local_ranks: int

    def __post_init__(self) -> None:
        for name in ("available", "overhead", "margin"):
            if getattr(self, name) < 0:
                raise TierserveError(f"host {name} must not be negative", field=name)
        if self.local_ranks <= 0:
            raise TierserveError(f"local ranks must be > 0, got {self.local_ranks}", "gpus")

    @property
    def usable(self) -> int:
        return max(0, self.available - self.overhead - self.margin)

    @property
    def max_bytes_per_rank(self) -> int:
        return self.usable // self.local_ranks

    def formula(self) -> str:
        return (
            f"({format_gb(self.available)} available − {format_gb(self.overhead)} overhead − "
            f"{format_gb(self.margin)} margin) / {self.local_ranks} local ranks = "
            f"{format_gb(self.max_bytes_per_rank)} per rank, rounded down"
        )


@dataclass(frozen=True)
class HostSizing:
    mode: HostMode
    tokens_per_rank: int
    bytes_per_rank: int  # this rank's share of the node's bytes (its whole copy unless shared)
    bytes_per_node: int
    max_tokens_per_rank: int  # the largest that fits
    max_bytes_per_rank: int
    fits: bool
    formula: str
    # Ranks that share one host copy (identical KV: MLA latents, replicated KV heads), and the
    # bytes of one copy (one pool). 1: per-rank copies, as SGLang and vLLM keep them.
    sharing: int = 1
    pool_bytes: int = 0


def _requested_host_tokens(
    request: HostRequest,
    bytes_per_token: int,
    device_tokens: int,
    budget: HostBudget,
    page: int,
    sharing: int,
) -> int:
    """Host tokens each rank's tree holds. A size is each rank's bytes; ranks that share one
    copy pool theirs, so the copy holds `sharing` times the tokens."""
    if request.mode == "ratio":
        ratio_tokens = int(device_tokens * request.ratio)
        return ratio_tokens - ratio_tokens % page
    if request.mode == "per_rank":
        return tokens_in(request.size * sharing, bytes_per_token, page)
    if request.mode == "per_node":
        return tokens_in(request.size // budget.local_ranks * sharing, bytes_per_token, page)
    if request.mode == "off":
        return 0
    return tokens_in(budget.max_bytes_per_rank * sharing, bytes_per_token, page)


def size_host_cache(
    bytes_per_token: int,
    device_tokens: int,
    request: HostRequest,
    budget: HostBudget,
    page_size: int = 1,
    sharing: int = 1,
) -> HostSizing:
    """Host cache per rank and per node for `request`, whether it fits, and the most that does.

    `bytes_per_token` and `device_tokens` are per rank. Each local rank keeps its own host
    cache, or each group of `sharing` ranks holding identical KV keeps one copy, so the node
    needs `copy bytes × local_ranks / sharing`; that must stay within
    available − overhead − margin.
    """
    args = (bytes_per_token, device_tokens, budget, page_size, sharing)
    tokens = _requested_host_tokens(request, *args)
    max_tokens = tokens_in(budget.max_bytes_per_rank * sharing, bytes_per_token, page_size)
    pool = tokens * bytes_per_token
    node = pool * (budget.local_ranks // sharing)
    return HostSizing(
        mode=request.mode,
        tokens_per_rank=tokens,
        bytes_per_rank=pool // sharing,
        bytes_per_node=node,
        max_tokens_per_rank=max_tokens,
        max_bytes_per_rank=budget.max_bytes_per_rank,
        fits=node <= budget.usable,
        formula=budget.formula(),
        sharing=sharing,
        pool_bytes=pool,
    )


def host_request(
    per_node: str | None, per_rank: str | None, ratio: float | None, off: bool = False
) -> HostRequest:
    """The host cache a user's flags ask for: a node's size, a rank's size ('auto': the largest
    that fits), a ratio of the device pool, none; with no flag, the largest that fits. The one
    reading of these flags, for `serve` and `plan` alike."""
    if off:
        return HostRequest("off")
    if per_node is not None:
        return HostRequest.per_node(_size(per_node, "hicache_node_size"))
    if per_rank is not None:
        if per_rank.strip().lower() == "auto":
            return HostRequest.auto()
        return HostRequest.per_rank(_size(per_rank, "hicache_size"))
    if ratio is not None:
        return HostRequest.of_ratio(ratio)
    return HostRequest.auto()


def _size(text: str, field: str) -> int:
    size = parse_size(text, field)
    if size == 0:  # SGLang reads 0 as "use the ratio"; here a size is a size
        raise TierserveError(
            f"{field} 0 holds nothing: give a size, 'auto', or leave it out to use --hicache-ratio",
            field=field,
        )
    return size
