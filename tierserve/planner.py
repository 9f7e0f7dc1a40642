"""KV cache sizing: bytes per token, device pool, host cache, and what SGLang/vLLM flags mean.

Pure functions over frozen dataclasses: no printing, no psutil, no files. `tierserve plan`
renders these results and `tierserve serve` calls the same functions at start-up, so the plan a
user reads is the plan the server allocates.

Vocabulary. Every size is an int of bytes. A *rank* is one tensor-parallel process (one GPU);
every rank of a TP group holds the same tokens, each its own share of their KV, so a token count
"per rank" is also the count for the whole model instance. A *node* is one machine: its ranks
share its host RAM, which is where per-rank host caches add up.

Formulas (DESIGN.md §3):
- MHA/GQA bytes/token = 2 (K and V) × layers × kv_heads × head_dim × dtype_bytes; a rank holds
  max(1, ceil(kv_heads / tp)) heads, so when tp > kv_heads heads are replicated across ranks.
- MLA bytes/token = layers × (kv_lora_rank + qk_rope_head_dim) × dtype_bytes, and every rank
  holds all of it (the latent is shared by all heads, so TP cannot split it).
- device pool per rank = GPU memory × mem_fraction_static − weights per rank.
- host cache per rank, at most = (available − overhead − margin) // local ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tierserve.cache.spec import KVSpec, kv_dtype_name
from tierserve.config import ModelConfig
from tierserve.errors import TierserveError
from tierserve.units import GB, GiB, format_count, format_gb
from tierserve.verdict import Constraint, constraints
from tierserve.weights import ModelSpec

# The planner's short name of each canonical KV dtype (what its tables print).
_SHORT_KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def short_kv_dtype(text: str) -> str:
    """The planner's short name for any spelling users bring (tierserve's, SGLang's, vLLM's:
    cache/spec.py knows them all); "" for auto (the model's dtype)."""
    if text.lower() == "auto":
        return ""
    canonical = kv_dtype_name(text.lower())
    return _SHORT_KV_DTYPE.get(canonical, "fp8" if canonical.startswith("fp8") else canonical)


# Host RAM one serving process needs beyond its KV cache (CUDA context, torch, pinned staging,
# tokenizer); the seed's 8-rank server took ~40 GB, i.e. ~5 GB a rank.
DEFAULT_OVERHEAD_PER_RANK = 5 * GB
# Kept free for the OS and page cache; equal to SGLang's own per-rank reserve, so that the last
# SGLang rank to allocate still passes its check.
DEFAULT_MARGIN = 10 * GiB


# ---------------------------------------------------------------------------------------------
# KV bytes per token: one KVSpec, the same object the engine's pools are built from


class KVBytes(NamedTuple):
    total: int  # one copy of the whole model's KV for one token
    per_rank: int  # what one rank's pool allocates for one token
    replicated: bool  # some ranks hold identical copies of the same KV


def kv_spec(model: ModelConfig, kv_dtype: str, tp: int = 1, page_size: int = 1) -> KVSpec:
    return KVSpec.from_model(model, kv_dtype, page_size, tp)


def kv_bytes(spec: KVSpec) -> KVBytes:
    return KVBytes(spec.total_bytes_per_token, spec.bytes_per_token, spec.replicated)


def override_per_rank(kv: KVBytes, per_rank: int) -> KVBytes:
    """Use a measured per-rank size (e.g. from a server log) and scale the total alike."""
    if per_rank <= 0:
        message = f"kv bytes per token must be > 0, got {per_rank}"
        raise TierserveError(message, field="kv_bytes_per_token")
    return KVBytes(per_rank * kv.total // kv.per_rank, per_rank, kv.replicated)


# ---------------------------------------------------------------------------------------------
# Device pool


def weights_per_rank(total_weight_bytes: int, tp: int) -> int:
    # TP splits every large matrix (attention, MLP, experts, vocabulary); norms are replicated,
    # but at a few MB they do not matter here.
    return math.ceil(total_weight_bytes / tp)


def device_pool_bytes(gpu_memory: int, mem_fraction_static: float, rank_weights: int) -> int:
    """KV pool of one rank = GPU memory × mem_fraction_static − the weights on that rank.

    This is SGLang's rule, and tierserve's: the static fraction holds weights and the KV pool,
    while activations, CUDA graphs and NCCL buffers live in the remaining (1 − fraction). SGLang
    measures after loading, so its pool comes out smaller by the CUDA context (~0.5–1 GB).
    """
    return max(0, int(gpu_memory * mem_fraction_static) - rank_weights)


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


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Machine:
    gpu_name: str
    gpu_memory: int  # bytes per GPU, as the driver reports it
    host_available: int  # bytes of host RAM available on one node
    host_source: str = "given"  # where host_available came from, for the reader
    gpus_per_node: int | None = None  # None: as many as --tp
    host_overhead: int | None = None  # None: DEFAULT_OVERHEAD_PER_RANK × local ranks
    host_margin: int = DEFAULT_MARGIN
    storage_ram_per_process: int = 0  # a storage client's RAM (Mooncake's segment + buffer)


@dataclass(frozen=True)
class Workload:
    avg_seq_len: int = 4000  # prompt + output tokens of an average request
    concurrency: int | None = None  # requests the user wants in flight


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    machine: Machine
    tp: int = 1
    kv_dtype: str = "bf16"
    mem_fraction_static: float = 0.85
    page_size: int = 1
    host: HostRequest = HostRequest()
    workload: Workload = Workload()
    kv_bytes_per_token_per_rank: int | None = None  # measured value that overrides the formula
    device_tokens_per_rank: int | None = None  # e.g. --max-total-tokens
    context_length: int | None = None  # the longest request that must fit, when asked
    pp: int = 1  # pipeline stages: each holds layers / pp, and is tp processes of its own
    dp: int = 1  # data-parallel replicas: each a whole tp × pp group with its own pools

    def __post_init__(self) -> None:
        kv_dtype_name(self.kv_dtype)
        positive = {"tp": self.tp, "page_size": self.page_size, "gpus": self.gpus_per_node}
        positive["pp"], positive["dp"] = self.pp, self.dp
        positive["avg_seq_len"] = self.workload.avg_seq_len
        positive["gpu_memory"] = self.machine.gpu_memory
        optional = {
            "concurrency": self.workload.concurrency,
            "max_total_tokens": self.device_tokens_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token_per_rank,
            "context_length": self.context_length,
        }
        positive.update({name: value for name, value in optional.items() if value is not None})
        for name, value in positive.items():
            if value <= 0:
                raise TierserveError(f"{name} must be > 0, got {value}", field=name)
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise TierserveError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}",
                field="mem_fraction_static",
            )
        self._check_layout()

    def _check_layout(self) -> None:
        """What SGLang and vLLM refuse at start-up, refused here before anyone launches."""
        cfg, tp = self.model.config, self.tp
        if cfg.num_heads % tp:
            message = f"tp {tp} does not divide the model's {cfg.num_heads} attention heads"
            raise TierserveError(message, field="tp")
        if not cfg.kv_lora_rank and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            message = (
                f"tp {tp} and the model's {cfg.num_kv_heads} KV heads: one must divide the other"
            )
            raise TierserveError(message, field="tp")
        if self.pp > cfg.num_layers:
            raise TierserveError(f"pp {self.pp} > the model's {cfg.num_layers} layers", "pp")
        gpus, ranks = self.gpus_per_node, self.processes
        if ranks > gpus and ranks % gpus:
            message = f"{ranks} ranks (tp × pp × dp) do not fill nodes of {gpus} GPUs evenly"
            raise TierserveError(message, field="gpus")
        max_len = cfg.max_position_embeddings
        if self.context_length is not None and max_len and self.context_length > max_len:
            message = (
                f"context_length {self.context_length} > the model's max_position_embeddings "
                f"{max_len}"
            )
            raise TierserveError(message, field="context_length")

    @property
    def gpus_per_node(self) -> int:
        return self.machine.gpus_per_node or self.processes

    @property
    def processes(self) -> int:
        """One per GPU: every TP rank of every pipeline stage of every data-parallel replica."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class LaunchFlags:
    tierserve: str
    sglang: str
    vllm: str


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    spec: KVSpec
    kv: KVBytes
    kv_copies: int
    local_ranks: int
    nodes: int
    weights_bytes_per_rank: int
    device_pool_bytes_per_rank: int
    device_tokens_per_rank: int
    budget: HostBudget
    host: HostSizing  # what was asked for
    recommended: HostSizing  # the largest that fits
    # tierserve's sizing at the recommended bytes: one host copy per group of local ranks that
    # hold identical KV (the same as `recommended` when nothing is replicated).
    shared: HostSizing
    warnings: tuple[str, ...]
    flags: LaunchFlags
    constraints: tuple[Constraint, ...] = ()

    @property
    def total_tokens_per_rank(self) -> int:
        return self.device_tokens_per_rank + self.host.tokens_per_rank

    @property
    def device_concurrency(self) -> int:
        """Requests running at once: each data-parallel replica runs its own."""
        return self.device_tokens_per_rank // self.inputs.workload.avg_seq_len * self.inputs.dp

    @property
    def cached_concurrency(self) -> int:
        return self.total_tokens_per_rank // self.inputs.workload.avg_seq_len * self.inputs.dp

    @property
    def fits(self) -> bool:
        """Every constraint holds (and there are some: an unchecked plan does not fit)."""
        return bool(self.constraints) and all(c.holds for c in self.constraints)

    @property
    def failed(self) -> tuple[Constraint, ...]:
        return tuple(c for c in self.constraints if not c.holds)

    @property
    def launchable(self) -> bool:
        """A server started with the launch flags would come up (device pool and RAM hold); a
        plan can be launchable and still not fit what was asked of it (context, concurrency)."""
        return not any(c.name in ("device memory", "host RAM") for c in self.failed)

    @property
    def longest_request(self) -> int:
        """Tokens of the longest request the device pool holds (all of its KV on the device)."""
        return self.device_tokens_per_rank

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plan", **_inputs_dict(self.inputs), **_results_dict(self)}


def _inputs_dict(inputs: PlanInputs) -> dict[str, Any]:
    return {
        "model": inputs.model.name,
        "attention": inputs.model.config.attention,
        "kv_dtype": inputs.kv_dtype,
        "tp": inputs.tp,
        "gpu": inputs.machine.gpu_name,
        "gpu_memory_bytes": inputs.machine.gpu_memory,
        "mem_fraction_static": inputs.mem_fraction_static,
        "page_size": inputs.page_size,
        "host_request": dataclasses.asdict(inputs.host),
        "pp": inputs.pp,
        "dp": inputs.dp,
        "context_length": inputs.context_length,
        "avg_seq_len": inputs.workload.avg_seq_len,
        "wanted_concurrency": inputs.workload.concurrency,
        "weights_bytes": inputs.model.weight_bytes,
        "weights_note": inputs.model.weight_note,
    }


def _results_dict(plan: Plan) -> dict[str, Any]:
    return {
        "kv_bytes_per_token": plan.kv.total,
        "kv_bytes_per_token_per_rank": plan.kv.per_rank,
        "kv_replicated": plan.kv.replicated,
        "kv_copies": plan.kv_copies,
        "local_ranks": plan.local_ranks,
        "nodes": plan.nodes,
        "weights_bytes_per_rank": plan.weights_bytes_per_rank,
        "device_pool_bytes_per_rank": plan.device_pool_bytes_per_rank,
        "device_tokens_per_rank": plan.device_tokens_per_rank,
        "device_concurrency": plan.device_concurrency,
        "host_available_bytes": plan.budget.available,
        "host_overhead_bytes": plan.budget.overhead,
        "host_margin_bytes": plan.budget.margin,
        "host_usable_bytes": plan.budget.usable,
        "host_mode": plan.host.mode,
        "host_bytes_per_rank": plan.host.bytes_per_rank,
        "host_bytes_per_node": plan.host.bytes_per_node,
        "host_tokens_per_rank": plan.host.tokens_per_rank,
        "host_max_bytes_per_rank": plan.recommended.max_bytes_per_rank,
        "host_max_tokens_per_rank": plan.recommended.max_tokens_per_rank,
        "recommended_host_bytes_per_rank": plan.recommended.bytes_per_rank,
        "recommended_host_bytes_per_node": plan.recommended.bytes_per_node,
        "tierserve_shared_host_tokens_per_rank": plan.shared.tokens_per_rank,
        "tierserve_host_copy_sharing": plan.shared.sharing,
        "host_formula": plan.budget.formula(),
        "total_tokens_per_rank": plan.total_tokens_per_rank,
        "cached_concurrency": plan.cached_concurrency,
        "fits": plan.fits,
        "constraints": [dataclasses.asdict(c) for c in plan.constraints],
        "failed": [c.name for c in plan.failed],
        "longest_request_tokens": plan.longest_request,
        "warnings": list(plan.warnings),
        "flags": dataclasses.asdict(plan.flags),
    }


def _kv_for(inputs: PlanInputs, spec: KVSpec) -> KVBytes:
    kv = kv_bytes(spec)
    if inputs.kv_bytes_per_token_per_rank is None:
        return kv
    return override_per_rank(kv, inputs.kv_bytes_per_token_per_rank)


def host_budget(machine: Machine, ranks: int) -> HostBudget:
    overhead = machine.host_overhead
    if overhead is None:
        overhead = DEFAULT_OVERHEAD_PER_RANK * ranks
    overhead += machine.storage_ram_per_process * ranks
    return HostBudget(machine.host_available, overhead, machine.host_margin, ranks)


def _device_side(inputs: PlanInputs, bytes_per_token: int) -> tuple[int, int, int]:
    """(weights, KV pool bytes, KV pool tokens) of one rank; a given token count wins."""
    rank_weights = weights_per_rank(inputs.model.weight_bytes, inputs.tp * inputs.pp)
    if inputs.device_tokens_per_rank is not None:
        tokens = inputs.device_tokens_per_rank
        return rank_weights, tokens * bytes_per_token, tokens
    pool = device_pool_bytes(inputs.machine.gpu_memory, inputs.mem_fraction_static, rank_weights)
    return rank_weights, pool, tokens_in(pool, bytes_per_token, inputs.page_size)


def make_plan(inputs: PlanInputs) -> Plan:
    """Everything `tierserve plan` prints, computed once."""
    # A pipeline stage holds its share of the layers, and their KV.
    cfg = inputs.model.config
    stage = dataclasses.replace(cfg, num_layers=math.ceil(cfg.num_layers / inputs.pp))
    spec = kv_spec(stage, inputs.kv_dtype, inputs.tp, inputs.page_size)
    kv = _kv_for(inputs, spec)
    ranks = local_ranks(inputs.processes, inputs.gpus_per_node)
    rank_weights, pool, device = _device_side(inputs, kv.per_rank)
    budget = host_budget(inputs.machine, ranks)
    host = size_host_cache(kv.per_rank, device, inputs.host, budget, inputs.page_size)
    host_args = (kv.per_rank, device, HostRequest.auto(), budget, inputs.page_size)
    best = size_host_cache(*host_args)
    plan = Plan(
        inputs=inputs,
        spec=spec,
        kv=kv,
        kv_copies=spec.copies,
        local_ranks=ranks,
        nodes=math.ceil(inputs.processes / inputs.gpus_per_node),
        weights_bytes_per_rank=rank_weights,
        device_pool_bytes_per_rank=pool,
        device_tokens_per_rank=device,
        budget=budget,
        host=host,
        recommended=best,
        shared=size_host_cache(*host_args, spec.host_sharing(ranks)),
        warnings=(),
        flags=LaunchFlags("", "", ""),
    )
    plan = dataclasses.replace(plan, constraints=constraints(plan))
    return dataclasses.replace(plan, warnings=plan_warnings(plan), flags=launch_flags(plan))


# ---------------------------------------------------------------------------------------------
# Warnings


def _per_rank_trap_warning(plan: Plan) -> list[str]:
    if plan.local_ranks <= 1:
        return []
    node_gb = plan.recommended.bytes_per_node // GB
    return [
        f"SGLang's --hicache-size is decimal GB PER RANK and each rank checks free RAM alone: "
        f"writing the node's total (--hicache-size {node_gb}) would ask for "
        f"{plan.local_ranks} × {node_gb} GB = {format_gb(plan.local_ranks * node_gb * GB, 0)}"
    ]


def _replication_warning(plan: Plan) -> list[str]:
    if plan.kv_copies <= 1:
        return []
    per_node = plan.recommended.bytes_per_node
    distinct = per_node // plan.kv_copies
    why = (
        "the MLA latent is identical on every rank"
        if plan.spec.kind == "latent"
        else f"{plan.inputs.model.config.num_kv_heads} KV heads < tp {plan.inputs.tp}, heads are "
        "replicated"
    )
    lines = [
        f"{why}: each rank's host cache holds the same KV as {plan.kv_copies - 1} other(s), "
        f"so {format_gb(per_node)} of host RAM hold {format_gb(distinct)} of distinct KV "
        "(SGLang and vLLM keep one copy per rank)"
    ]
    shared = plan.shared
    if shared.sharing > 1:
        ranks, rank_gb = plan.local_ranks, format_gb(plan.recommended.bytes_per_rank)
        lines.append(
            f"tierserve keeps one host copy per {shared.sharing} ranks instead: {ranks} × "
            f"{rank_gb} = {format_gb(shared.bytes_per_node)} holds "
            f"{format_count(shared.tokens_per_rank)} tokens; per-rank copies would hold "
            f"{format_count(plan.recommended.tokens_per_rank)}"
        )
    return lines


def _ratio_warning(plan: Plan) -> list[str]:
    host, device = plan.host.tokens_per_rank, plan.device_tokens_per_rank
    if host == 0 or host > device:
        return []
    return [
        f"host cache ({format_count(host)} tokens) is not larger than the device pool "
        f"({format_count(device)}): it holds little that the GPU does not already; some SGLang "
        "releases refuse to start with this (an assert), newer ones warn"
    ]


def plan_warnings(plan: Plan) -> tuple[str, ...]:
    checks = (
        _per_rank_trap_warning,
        _replication_warning,
        _ratio_warning,
    )
    return tuple(line for check in checks for line in check(plan))


# ---------------------------------------------------------------------------------------------
# Launch flags


def _fitting_host(plan: Plan) -> HostSizing | None:
    """The host cache the launch lines ask for: the requested one when it fits, else the
    largest that does; None when there is to be none (asked for none, or none fits)."""
    if plan.host.mode == "off":
        return None
    host = plan.host if plan.host.fits else plan.recommended
    return host if host.bytes_per_rank >= GB else None  # under 1 GB a rank: not worth a tier


def sglang_size_gb(max_bytes_per_rank: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Largest whole `--hicache-size` (decimal GB per rank) within `max_bytes_per_rank`, counting
    the page SGLang adds when it rounds the pool up."""
    return max(0, (max_bytes_per_rank - page_size * bytes_per_token) // GB)


def _kv_dtype_flag(plan: Plan, fp8: str) -> str:
    return f" --kv-cache-dtype {fp8}" if plan.inputs.kv_dtype == "fp8" else ""


def _sglang_host_flags(plan: Plan, host: HostSizing) -> str:
    """A ratio stays a ratio; any size becomes whole decimal GB per rank, as SGLang wants it."""
    if host.mode == "ratio":
        return f" --enable-hierarchical-cache --hicache-ratio {plan.inputs.host.ratio:g}"
    largest = sglang_size_gb(host.max_bytes_per_rank, plan.kv.per_rank, plan.inputs.page_size)
    size_gb = min(round(host.bytes_per_rank / GB), largest)
    return f" --enable-hierarchical-cache --hicache-size {size_gb}" if size_gb > 0 else ""


def launch_flags(plan: Plan) -> LaunchFlags:
    """Flags that give each server the plan's device pool and a host cache that fits."""
    host = _fitting_host(plan)
    # Exact: the launch gets the plan's pool, not one token more or less.
    frac = repr(plan.inputs.mem_fraction_static)
    return LaunchFlags(
        _tierserve_flags(plan, host, frac),
        _sglang_flags(plan, host, frac),
        _vllm_flags(plan, host, frac),
    )


def _tierserve_flags(plan: Plan, host: HostSizing | None, frac: str) -> str:
    # Only flags `tierserve serve` has (tensor parallelism; no pipeline or data parallelism).
    # Its page size and KV dtype always, since its defaults (16 tokens, the model's dtype)
    # differ from the plan's.
    inputs = plan.inputs
    flags = f"--tp-size {inputs.tp} " if inputs.tp > 1 else ""
    flags += f"--mem-fraction-static {frac}"
    if inputs.device_tokens_per_rank is not None:
        flags += f" --max-total-tokens {inputs.device_tokens_per_rank}"
    flags += f" --page-size {inputs.page_size}" + _kv_dtype_flag(plan, "fp8_e4m3")
    if inputs.context_length is not None:
        flags += f" --context-length {inputs.context_length}"
    if host is not None:
        flags += f" --enable-hierarchical-cache --hicache-node-size {host.bytes_per_node // GB}GB"
    return flags


def _sglang_flags(plan: Plan, host: HostSizing | None, frac: str) -> str:
    inputs = plan.inputs
    flags = f"--tp-size {inputs.tp}" + (f" --pp-size {inputs.pp}" if inputs.pp > 1 else "")
    flags += f" --dp-size {inputs.dp}" if inputs.dp > 1 else ""
    flags += f" --mem-fraction-static {frac}"
    if inputs.device_tokens_per_rank is not None:
        flags += f" --max-total-tokens {inputs.device_tokens_per_rank}"
    if inputs.page_size != 1:  # SGLang's default page is 1 token, as the plan's
        flags += f" --page-size {inputs.page_size}"
    flags += _kv_dtype_flag(plan, "fp8_e4m3")
    return flags + (_sglang_host_flags(plan, host) if host is not None else "")


def _vllm_flags(plan: Plan, host: HostSizing | None, frac: str) -> str:
    inputs = plan.inputs
    flags = f"--tensor-parallel-size {inputs.tp} --gpu-memory-utilization {frac}"
    flags += f" --pipeline-parallel-size {inputs.pp}" if inputs.pp > 1 else ""
    flags += f" --data-parallel-size {inputs.dp}" if inputs.dp > 1 else ""
    flags += f" --block-size {inputs.page_size}" if inputs.page_size != 1 else ""
    # vLLM refuses to start unless one request of max_model_len (default: the model's
    # max_position_embeddings) fits in the pool: cap it at what the plan's pool holds.
    block = inputs.page_size if inputs.page_size != 1 else 16  # vLLM's default block
    cfg_max = inputs.model.config.max_position_embeddings
    max_len = min(inputs.context_length or cfg_max, plan.device_tokens_per_rank // block * block)
    if max_len < cfg_max or inputs.context_length:
        flags += f" --max-model-len {max_len}"
    if inputs.device_tokens_per_rank is not None:  # vLLM's --max-total-tokens, in blocks
        flags += f" --num-gpu-blocks-override {inputs.device_tokens_per_rank // block}"
    flags += _kv_dtype_flag(plan, "fp8")
    # vLLM's --kv-offloading-size is GiB for the whole instance, split across its workers.
    gib = host.bytes_per_rank * inputs.tp * inputs.pp // GiB if host is not None else 0
    if gib > 0:
        flags += f" --kv-offloading-backend native --kv-offloading-size {gib}"
    return flags
