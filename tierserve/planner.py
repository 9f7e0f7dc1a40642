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

import argparse
import dataclasses
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tierserve.cache.spec import KVSpec, kv_dtype_name
from tierserve.config import ModelConfig, text_config
from tierserve.errors import TierserveError
from tierserve.units import GB, GiB, format_bytes, format_count, format_gb

# The planner speaks SGLang/vLLM-style short names for KV dtypes; the spec knows their widths.
KV_DTYPE_CHOICES = ("fp32", "bf16", "fp16", "fp8")
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
}
# Host RAM one serving process needs beyond its KV cache (CUDA context, torch, pinned staging,
# tokenizer); the seed's 8-rank server took ~40 GB, i.e. ~5 GB a rank.
DEFAULT_OVERHEAD_PER_RANK = 5 * GB
# Kept free for the OS and page cache; equal to SGLang's own per-rank reserve, so that the last
# SGLang rank to allocate still passes its check.
DEFAULT_MARGIN = 10 * GiB
SGLANG_HOST_RESERVE = 10 * GiB  # SGLang: each rank requires requested <= available - 10 GiB
SGLANG_DEFAULT_RATIO = 2.0


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


def _require(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise TierserveError(f"model config lacks {key!r}", field="model")
    return config[key]


def override_per_rank(kv: KVBytes, per_rank: int) -> KVBytes:
    """Use a measured per-rank size (e.g. from a server log) and scale the total alike."""
    if per_rank <= 0:
        message = f"kv bytes per token must be > 0, got {per_rank}"
        raise TierserveError(message, field="kv_bytes_per_token")
    return KVBytes(per_rank * kv.total // kv.per_rank, per_rank, kv.replicated)


# ---------------------------------------------------------------------------------------------
# Weights


def _gqa_attention_params(raw: Mapping[str, Any]) -> int:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o + k, v


def _mla_attention_params(raw: Mapping[str, Any]) -> int:
    hidden, heads, q_rank = raw["hidden_size"], raw["num_attention_heads"], raw.get("q_lora_rank")
    nope, rope, v_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    kv_rank = raw["kv_lora_rank"]
    q_out = heads * (nope + rope)
    q = q_rank * (hidden + 1 + q_out) if q_rank else hidden * q_out
    kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _is_dense_layer(raw: Mapping[str, Any], layer: int) -> bool:
    if layer < raw.get("first_k_dense_replace", 0) or layer in raw.get("mlp_only_layers", ()):
        return True
    return layer % raw.get("decoder_sparse_step", raw.get("moe_layer_freq", 1)) != 0


def _mlp_params(raw: Mapping[str, Any], layer: int) -> int:
    """Gated MLP (gate, up, down); an MoE layer holds all its experts, shared ones and router."""
    hidden = raw["hidden_size"]
    experts = raw.get("n_routed_experts") or raw.get("num_experts") or raw.get("num_local_experts")
    if not experts or _is_dense_layer(raw, layer):
        return 3 * hidden * raw["intermediate_size"]
    expert_inter = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    shared = raw.get("n_shared_experts", 0) * expert_inter
    shared += raw.get("shared_expert_intermediate_size", 0)
    return 3 * hidden * (experts * expert_inter + shared) + experts * hidden


def estimate_parameters(config: Mapping[str, Any]) -> int:
    """Parameter count from config.json alone (within ~1% of published counts for the presets).

    Counts embeddings, attention, MLP/experts and norms; leaves out biases and MTP layers.
    """
    raw = text_config(config)
    hidden, layers = _require(raw, "hidden_size"), _require(raw, "num_hidden_layers")
    attention = _mla_attention_params(raw) if raw.get("kv_lora_rank") else None
    total = 0
    for layer in range(layers):
        total += attention or _gqa_attention_params(raw)
        total += _mlp_params(raw, layer) + 2 * hidden  # two RMSNorms
    embeddings = _require(raw, "vocab_size") * hidden
    return total + embeddings * (1 if raw.get("tie_word_embeddings") else 2) + hidden


def checkpoint_weight_dtype(config: Mapping[str, Any]) -> str:
    """The dtype of a checkpoint's large matrices, from quantization_config or torch_dtype."""
    raw = text_config(config)
    quant = raw.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    group = (quant.get("config_groups") or {}).get("group_0", {}).get("weights", {})
    bits = quant.get("bits") or group.get("num_bits")
    if method == "mxfp4" or (method and bits == 4):
        return "int4"
    if method == "fp8":
        return "fp8"
    if method and bits == 8:
        return "int8"
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")


def weight_bytes(num_parameters: int, weight_dtype: str) -> int:
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        known = ", ".join(WEIGHT_DTYPE_BYTES)
        raise TierserveError(f"unknown weight dtype {weight_dtype!r}; known: {known}", "weights")
    return int(num_parameters * WEIGHT_DTYPE_BYTES[weight_dtype])


@dataclass(frozen=True)
class ModelSpec:
    """A model as sizing sees it: KV shape and the bytes of its weights (all ranks together)."""

    name: str
    config: ModelConfig
    weight_bytes: int
    weight_note: str  # where weight_bytes came from, for the reader of the plan
    path: str = ""  # what a server's --model flag should say (HF id or local directory)


def model_spec(
    name: str,
    config: Mapping[str, Any],
    num_parameters: int | None = None,
    weight_dtype: str | None = None,
    weights: int | None = None,
) -> ModelSpec:
    """ModelSpec from config.json; `weights` (bytes, e.g. the checkpoint's size) wins."""
    kv = ModelConfig.from_dict(config)
    if weights is not None:
        return ModelSpec(name, kv, weights, f"{format_gb(weights)} as given")
    params = num_parameters or estimate_parameters(config)
    dtype = weight_dtype or checkpoint_weight_dtype(config)
    note = f"{params / 1e9:,.1f}B params × {dtype}"
    return ModelSpec(name, kv, weight_bytes(params, dtype), note)


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


def local_ranks(tp: int, gpus_per_node: int) -> int:
    """Ranks sharing one node's host RAM: all of them when TP spans nodes, else every TP group
    (data-parallel copies) that fits on the node's GPUs."""
    if tp >= gpus_per_node:
        return gpus_per_node
    return gpus_per_node // tp * tp


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
        if self.ratio < 0 or self.size < 0:
            raise TierserveError("host cache size and ratio must not be negative", "host_cache")

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
    bytes_per_rank: int
    bytes_per_node: int
    max_tokens_per_rank: int  # the largest that fits
    max_bytes_per_rank: int
    fits: bool
    formula: str


def _requested_host_tokens(
    request: HostRequest, bytes_per_token: int, device_tokens: int, budget: HostBudget, page: int
) -> int:
    if request.mode == "ratio":
        ratio_tokens = int(device_tokens * request.ratio)
        return ratio_tokens - ratio_tokens % page
    if request.mode == "per_rank":
        return tokens_in(request.size, bytes_per_token, page)
    if request.mode == "per_node":
        return tokens_in(request.size // budget.local_ranks, bytes_per_token, page)
    if request.mode == "off":
        return 0
    return tokens_in(budget.max_bytes_per_rank, bytes_per_token, page)


def size_host_cache(
    bytes_per_token: int,
    device_tokens: int,
    request: HostRequest,
    budget: HostBudget,
    page_size: int = 1,
) -> HostSizing:
    """Host cache per rank and per node for `request`, whether it fits, and the most that does.

    `bytes_per_token` and `device_tokens` are per rank. Each local rank keeps its own host cache,
    so the node needs `bytes_per_rank × local_ranks`; that must stay within
    available − overhead − margin.
    """
    tokens = _requested_host_tokens(request, bytes_per_token, device_tokens, budget, page_size)
    max_tokens = tokens_in(budget.max_bytes_per_rank, bytes_per_token, page_size)
    per_rank = tokens * bytes_per_token
    return HostSizing(
        mode=request.mode,
        tokens_per_rank=tokens,
        bytes_per_rank=per_rank,
        bytes_per_node=per_rank * budget.local_ranks,
        max_tokens_per_rank=max_tokens,
        max_bytes_per_rank=budget.max_bytes_per_rank,
        fits=per_rank * budget.local_ranks <= budget.usable,
        formula=budget.formula(),
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

    def __post_init__(self) -> None:
        kv_dtype_name(self.kv_dtype)
        positive = {"tp": self.tp, "page_size": self.page_size, "gpus": self.gpus_per_node}
        positive["avg_seq_len"] = self.workload.avg_seq_len
        positive["gpu_memory"] = self.machine.gpu_memory
        optional = {
            "concurrency": self.workload.concurrency,
            "max_total_tokens": self.device_tokens_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token_per_rank,
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

    @property
    def gpus_per_node(self) -> int:
        return self.machine.gpus_per_node or self.tp


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
    warnings: tuple[str, ...]
    flags: LaunchFlags

    @property
    def total_tokens_per_rank(self) -> int:
        return self.device_tokens_per_rank + self.host.tokens_per_rank

    @property
    def device_concurrency(self) -> int:
        return self.device_tokens_per_rank // self.inputs.workload.avg_seq_len

    @property
    def cached_concurrency(self) -> int:
        return self.total_tokens_per_rank // self.inputs.workload.avg_seq_len

    @property
    def fits(self) -> bool:
        return self.device_tokens_per_rank > 0 and self.host.fits

    def to_dict(self) -> dict[str, Any]:
        return {**_inputs_dict(self.inputs), **_results_dict(self)}


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
        "host_formula": plan.budget.formula(),
        "total_tokens_per_rank": plan.total_tokens_per_rank,
        "cached_concurrency": plan.cached_concurrency,
        "fits": plan.fits,
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
    return HostBudget(machine.host_available, overhead, machine.host_margin, ranks)


def _device_side(inputs: PlanInputs, bytes_per_token: int) -> tuple[int, int, int]:
    """(weights, KV pool bytes, KV pool tokens) of one rank; a given token count wins."""
    rank_weights = weights_per_rank(inputs.model.weight_bytes, inputs.tp)
    if inputs.device_tokens_per_rank is not None:
        tokens = inputs.device_tokens_per_rank
        return rank_weights, tokens * bytes_per_token, tokens
    pool = device_pool_bytes(inputs.machine.gpu_memory, inputs.mem_fraction_static, rank_weights)
    return rank_weights, pool, tokens_in(pool, bytes_per_token, inputs.page_size)


def make_plan(inputs: PlanInputs) -> Plan:
    """Everything `tierserve plan` prints, computed once."""
    spec = kv_spec(inputs.model.config, inputs.kv_dtype, inputs.tp, inputs.page_size)
    kv = _kv_for(inputs, spec)
    ranks = local_ranks(inputs.tp, inputs.gpus_per_node)
    rank_weights, pool, device = _device_side(inputs, kv.per_rank)
    budget = host_budget(inputs.machine, ranks)
    host = size_host_cache(kv.per_rank, device, inputs.host, budget, inputs.page_size)
    best = size_host_cache(kv.per_rank, device, HostRequest.auto(), budget, inputs.page_size)
    plan = Plan(
        inputs=inputs,
        spec=spec,
        kv=kv,
        kv_copies=spec.copies,
        local_ranks=ranks,
        nodes=math.ceil(inputs.tp / inputs.gpus_per_node),
        weights_bytes_per_rank=rank_weights,
        device_pool_bytes_per_rank=pool,
        device_tokens_per_rank=device,
        budget=budget,
        host=host,
        recommended=best,
        warnings=(),
        flags=LaunchFlags("", "", ""),
    )
    return dataclasses.replace(plan, warnings=plan_warnings(plan), flags=launch_flags(plan))


# ---------------------------------------------------------------------------------------------
# Warnings


def _device_warning(plan: Plan) -> list[str]:
    if plan.device_tokens_per_rank > 0:
        return []
    inputs = plan.inputs
    static = int(inputs.machine.gpu_memory * inputs.mem_fraction_static)
    return [
        f"no room for KV on the GPU: weights per rank {format_gb(plan.weights_bytes_per_rank)} "
        f"≥ GPU memory × mem-fraction-static = {format_gb(static)}; use more GPUs (--tp), "
        "a smaller checkpoint (--weight-dtype, --weights) or a larger --mem-fraction-static"
    ]


def _host_warning(plan: Plan) -> list[str]:
    if plan.host.fits:
        return []
    return [
        f"host cache does not fit: {plan.local_ranks} ranks × "
        f"{format_gb(plan.host.bytes_per_rank)} = {format_gb(plan.host.bytes_per_node)} > "
        f"{format_gb(plan.budget.usable)} usable; the most that fits is "
        f"{format_gb(plan.recommended.max_bytes_per_rank)} per rank"
    ]


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
    return [
        f"{why}: each rank's host cache holds the same KV as {plan.kv_copies - 1} other(s), "
        f"so {format_gb(per_node)} of host RAM hold {format_gb(distinct)} of distinct KV "
        "(SGLang and vLLM keep one copy per rank)"
    ]


def _concurrency_warning(plan: Plan) -> list[str]:
    wanted, length = plan.inputs.workload.concurrency, plan.inputs.workload.avg_seq_len
    if wanted is None or wanted <= plan.device_concurrency:
        return []
    text = (
        f"{wanted} requests × {format_count(length)} tokens = {format_count(wanted * length)} "
        f"tokens > device pool {format_count(plan.device_tokens_per_rank)}: only "
        f"{plan.device_concurrency} run at once"
    )
    if wanted <= plan.cached_concurrency:
        return [text + "; the host cache keeps the others' KV for reload instead of recompute"]
    return [text + f"; device + host hold the KV of {plan.cached_concurrency} requests"]


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
        _device_warning,
        _host_warning,
        _per_rank_trap_warning,
        _replication_warning,
        _ratio_warning,
        _concurrency_warning,
    )
    return tuple(line for check in checks for line in check(plan))


# ---------------------------------------------------------------------------------------------
# Launch flags


def _fitting_host(plan: Plan) -> HostSizing:
    return plan.host if plan.host.fits and plan.host.mode != "off" else plan.recommended


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
    inputs, host = plan.inputs, _fitting_host(plan)
    frac = f"{inputs.mem_fraction_static:g}"
    # Only flags `tierserve serve` has today (no --tp or KV dtype yet: one GPU per server).
    tierserve = f"--mem-fraction-static {frac} --enable-hierarchical-cache"
    tierserve += f" --hicache-node-size {host.bytes_per_node // GB}GB"
    sglang = f"--tp-size {inputs.tp} --mem-fraction-static {frac}"
    sglang += _kv_dtype_flag(plan, "fp8_e4m3") + _sglang_host_flags(plan, host)
    # vLLM's --kv-offloading-size is GiB for the whole instance, split across its TP ranks.
    vllm_gib = host.bytes_per_rank * inputs.tp // GiB
    vllm = f"--tensor-parallel-size {inputs.tp} --gpu-memory-utilization {frac}"
    vllm += _kv_dtype_flag(plan, "fp8")
    if vllm_gib > 0:
        vllm += f" --kv-offloading-backend native --kv-offloading-size {vllm_gib}"
    return LaunchFlags(tierserve, sglang, vllm)


# ---------------------------------------------------------------------------------------------
# SGLang command lines


@dataclass(frozen=True)
class SGLangFlags:
    """The part of an SGLang command line that decides memory, with SGLang's defaults."""

    tp: int = 1
    dp: int = 1
    nnodes: int = 1
    dp_attention: bool = False
    hierarchical: bool = False
    hicache_size_gb: int = 0  # SGLang: int, decimal GB, per rank; 0 = use the ratio
    hicache_ratio: float = SGLANG_DEFAULT_RATIO
    page_size: int = 1
    mem_fraction_static: float | None = None  # None: SGLang picks one from the GPU size
    kv_cache_dtype: str | None = None
    max_total_tokens: int | None = None
    model_path: str | None = None

    @property
    def local_ranks(self) -> int:
        # Every rank is a process with its own host pool; DP without DP-attention adds TP groups.
        groups = 1 if self.dp_attention else self.dp
        return max(1, self.tp * groups // self.nnodes)


def _sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--tp-size", "--tp", dest="tp", type=int, default=1)
    add("--dp-size", "--dp", dest="dp", type=int, default=1)
    add("--nnodes", type=int, default=1)
    add("--enable-dp-attention", dest="dp_attention", action="store_true")
    add("--enable-hierarchical-cache", dest="hierarchical", action="store_true")
    add("--hicache-size", dest="hicache_size_gb", type=int, default=0)
    add("--hicache-ratio", type=float, default=SGLANG_DEFAULT_RATIO)
    add("--page-size", type=int, default=1)
    add("--mem-fraction-static", type=float, default=None)
    add("--kv-cache-dtype", default=None)
    add("--max-total-tokens", type=int, default=None)
    add("--model-path", "--model", dest="model_path", default=None)
    return parser


def parse_sglang_flags(flags: str) -> SGLangFlags:
    """Read an SGLang command line (a whole `python -m sglang.launch_server …` line is fine);
    flags that do not affect memory are ignored."""
    try:
        words = shlex.split(flags.replace("\\\n", " "))
        ns, _ignored = _sglang_parser().parse_known_args(words)
    except (ValueError, argparse.ArgumentError) as err:
        # SGLang's own parser rejects these too, e.g. --hicache-size 300GB (it takes an int).
        raise TierserveError(f"cannot read SGLang flags: {err}", field="check_sglang") from err
    parsed = SGLangFlags(**vars(ns))
    if parsed.tp <= 0 or parsed.dp <= 0 or parsed.nnodes <= 0 or parsed.page_size <= 0:
        raise TierserveError("SGLang --tp-size, --dp-size, --nnodes, --page-size must be > 0")
    if parsed.hicache_size_gb < 0 or parsed.hicache_ratio < 0:
        raise TierserveError("SGLang --hicache-size and --hicache-ratio must not be negative")
    return parsed


def sglang_kv_dtype(kv_cache_dtype: str | None, default: str) -> str:
    if kv_cache_dtype in (None, "auto"):
        return default
    if kv_cache_dtype.startswith("fp8"):
        return "fp8"
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(kv_cache_dtype, "bf16")


def sglang_host_tokens(bytes_per_token: int, device_tokens: int, flags: SGLangFlags) -> int:
    """SGLang's host pool size in tokens: `--hicache-size` wins over the ratio, then the size is
    rounded up to whole pages plus one."""
    if flags.hicache_size_gb > 0:
        tokens = flags.hicache_size_gb * GB // bytes_per_token
    else:
        tokens = int(device_tokens * flags.hicache_ratio)
    return (tokens // flags.page_size + 1) * flags.page_size


@dataclass(frozen=True)
class SGLangCheck:
    flags: SGLangFlags
    plan: Plan  # the plan under the command line's TP, fraction, dtype and page size
    host_tokens_per_rank: int
    host_bytes_per_rank: int
    host_bytes_per_node: int
    fits: bool
    suggestion: str  # flags that fit ("" when the command already does)
    lines: tuple[str, ...]  # the arithmetic, one step a line

    def to_dict(self) -> dict[str, Any]:
        return {
            "sglang_flags": dataclasses.asdict(self.flags),
            "local_ranks": self.flags.local_ranks,
            "kv_bytes_per_token_per_rank": self.plan.kv.per_rank,
            "kv_replicated": self.plan.kv.replicated,
            "device_tokens_per_rank": self.plan.device_tokens_per_rank,
            "host_tokens_per_rank": self.host_tokens_per_rank,
            "host_bytes_per_rank": self.host_bytes_per_rank,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_usable_bytes": self.plan.budget.usable,
            "host_max_bytes_per_rank": self.plan.budget.max_bytes_per_rank,
            "fits": self.fits,
            "suggestion": self.suggestion,
            "explanation": list(self.lines),
        }


def _sglang_inputs(flags: SGLangFlags, inputs: PlanInputs) -> PlanInputs:
    """The plan inputs with what the SGLang command line says instead of the plan's own flags."""
    device = inputs.device_tokens_per_rank
    if flags.max_total_tokens is not None:
        device = min(device or flags.max_total_tokens, flags.max_total_tokens)
    return dataclasses.replace(
        inputs,
        machine=dataclasses.replace(inputs.machine, gpus_per_node=flags.local_ranks),
        tp=flags.tp,
        kv_dtype=sglang_kv_dtype(flags.kv_cache_dtype, inputs.kv_dtype),
        mem_fraction_static=flags.mem_fraction_static or inputs.mem_fraction_static,
        page_size=flags.page_size,
        host=HostRequest.auto(),
        device_tokens_per_rank=device,
    )


def _sglang_request_line(flags: SGLangFlags, plan: Plan, tokens: int) -> str:
    bpt, per_rank = format_bytes(plan.kv.per_rank), format_gb(tokens * plan.kv.per_rank)
    rounded = f"{format_count(tokens)} tokens after SGLang rounds up to pages (+1 page)"
    if flags.hicache_size_gb > 0:
        size = flags.hicache_size_gb
        return (
            f"--hicache-size {size} = {size} × 10^9 B PER RANK: {size} × 10^9 // {bpt} per token "
            f"→ {rounded} = {per_rank} per rank"
        )
    return (
        f"--hicache-ratio {flags.hicache_ratio:g} (no --hicache-size): device pool "
        f"{format_count(plan.device_tokens_per_rank)} tokens × {flags.hicache_ratio:g} → {rounded}"
        f" × {bpt} = {per_rank} per rank"
    )


def _sglang_suggestion(plan: Plan, page_size: int) -> str:
    budget, bpt = plan.budget, plan.kv.per_rank
    size_gb = sglang_size_gb(budget.max_bytes_per_rank, bpt, page_size)
    max_tokens = budget.max_bytes_per_rank // bpt - page_size
    ratio = math.floor(10 * max_tokens / max(1, plan.device_tokens_per_rank)) / 10
    text = f"--hicache-size {size_gb} ({budget.local_ranks} × {size_gb} GB = "
    text += f"{format_gb(budget.local_ranks * size_gb * GB, 0)})"
    return text + f" or --hicache-ratio {ratio:g}" if ratio > 0 else text


def _sglang_verdict_lines(plan: Plan, per_rank: int, fits: bool) -> list[str]:
    budget = plan.budget
    per_node = per_rank * budget.local_ranks
    lines = [
        f"{budget.local_ranks} ranks × {format_gb(per_rank)} = {format_gb(per_node)} requested "
        "on this node (every rank allocates its own host pool)",
        f"host RAM: {format_gb(budget.available)} available − {format_gb(budget.overhead)} "
        f"overhead − {format_gb(budget.margin)} margin = {format_gb(budget.usable)} usable",
    ]
    if fits:
        return [*lines, f"fits: {format_gb(per_node)} ≤ {format_gb(budget.usable)}"]
    return [*lines, f"does NOT fit: {format_gb(per_node)} > {format_gb(budget.usable)}"]


def _sglang_own_check_line(plan: Plan, per_rank: int) -> str:
    """What SGLang itself will say: each rank compares its own pool with free RAM − 10 GiB."""
    available = plan.budget.available
    test = f"{format_gb(per_rank)} ≤ {format_gb(available)} − 10 GiB"
    if per_rank > available - SGLANG_HOST_RESERVE:
        return f"SGLang's own per-rank check fails ({test} is false): it refuses to start"
    return (
        f"SGLang's own check passes ({test}) because each rank checks alone: ranks that "
        "allocate together exhaust the node's RAM (the server hangs or is OOM-killed)"
    )


def check_sglang(flags: str, inputs: PlanInputs) -> SGLangCheck:
    """Does this SGLang command line fit the machine in `inputs`? With SGLang's semantics:
    `--hicache-size` is decimal GB per rank, else host tokens = device tokens × `--hicache-ratio`.
    `inputs` supplies the model, machine and anything the command line leaves out."""
    parsed = parse_sglang_flags(flags)
    plan = make_plan(_sglang_inputs(parsed, inputs))
    lines = [f"SGLang reads: {parsed.tp} TP ranks, {parsed.local_ranks} on this node"]
    if not parsed.hierarchical:
        lines.append("--enable-hierarchical-cache is not set: no host cache, sizes are ignored")
        fits = plan.device_tokens_per_rank > 0
        return SGLangCheck(parsed, plan, 0, 0, 0, fits, "", tuple(lines))
    tokens = sglang_host_tokens(plan.kv.per_rank, plan.device_tokens_per_rank, parsed)
    per_rank = tokens * plan.kv.per_rank
    fits = per_rank * plan.local_ranks <= plan.budget.usable and plan.device_tokens_per_rank > 0
    lines.append(_sglang_request_line(parsed, plan, tokens))
    lines += _sglang_verdict_lines(plan, per_rank, fits)
    suggestion = "" if fits else _sglang_suggestion(plan, parsed.page_size)
    if suggestion:
        lines += [_sglang_own_check_line(plan, per_rank), f"what fits: {suggestion}"]
    node = per_rank * plan.local_ranks
    return SGLangCheck(parsed, plan, tokens, per_rank, node, fits, suggestion, tuple(lines))
