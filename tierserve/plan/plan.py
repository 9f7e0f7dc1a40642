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
- data-parallel attention (dp groups of tp / dp ranks): KV per rank as at tp / dp, each group's
  pool its own requests' tokens, so requests at once = dp × one pool's; the attention side of
  the weights is split over a group only.
- host cache per rank, at most = (available − overhead − margin) // local ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tierserve.args import check_mem_fraction
from tierserve.errors import TierserveError
from tierserve.plan.weights import ModelSpec
from tierserve.sizing import (
    DEFAULT_MARGIN,
    DEFAULT_OVERHEAD_PER_RANK,
    DraftSize,
    HostBudget,
    HostRequest,
    HostSizing,
    KVBytes,
    KVSpec,
    device_pool_bytes,
    kv_bytes,
    kv_dtype_name,
    kv_spec,
    local_ranks,
    override_per_rank,
    size_host_cache,
    tokens_in,
    weights_per_rank,
)
from tierserve.utils import format_bytes, format_gb

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


# Prompt + output tokens of an average request, when the user does not say (the seed's job).
DEFAULT_AVG_SEQ_LEN = 4000


@dataclass(frozen=True)
class Workload:
    avg_seq_len: int = DEFAULT_AVG_SEQ_LEN
    concurrency: int | None = None  # requests the user wants in flight


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    machine: Machine
    tp: int = 1
    kv_dtype: str = "bf16"
    mem_fraction_static: float = 0.85
    page_size: int = 1
    host: HostRequest = dataclasses.field(default_factory=HostRequest)
    workload: Workload = Workload()
    kv_bytes_per_token_per_rank: int | None = None  # measured value that overrides the formula
    device_tokens_per_rank: int | None = None  # e.g. --max-total-tokens
    context_length: int | None = None  # the longest request that must fit, when asked
    pp: int = 1  # pipeline stages: each holds layers / pp, and is tp processes of its own
    dp: int = 1  # data-parallel replicas (each a whole tp × pp group with its own pools), or
    # with dp_attention attention groups inside the tp ranks (SGLang's --enable-dp-attention):
    # each group of tp / dp ranks holds its own requests' KV; the MLP and experts span all tp.
    dp_attention: bool = False
    dense_per_group: bool = False  # vLLM's form: dense MLPs and shared experts per group too
    draft: DraftSize | None = None  # a speculative draft model's weights and KV layer

    def __post_init__(self) -> None:
        kv_dtype_name(self.kv_dtype)
        # --gpus as given: 0 would read as unset (as many as the ranks) in gpus_per_node.
        given = self.machine.gpus_per_node
        gpus = self.gpus_per_node if given is None else given
        positive = {"tp": self.tp, "page_size": self.page_size, "gpus": gpus}
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
        check_mem_fraction(self.mem_fraction_static)
        self._check_layout()

    def _check_layout(self) -> None:
        """What SGLang and vLLM refuse at start-up, refused here before anyone launches."""
        if self.dp_attention and (self.dp < 2 or self.tp % self.dp):
            message = f"DP attention needs dp > 1 dividing tp, got tp {self.tp}, dp {self.dp}"
            raise TierserveError(message, field="dp")
        cfg, tp = self.model.config, self.attention_tp
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
        """One per GPU: every TP rank of every pipeline stage of every data-parallel replica
        (attention groups are made of the tp ranks, not added to them)."""
        return self.tp * self.pp * (1 if self.dp_attention else self.dp)

    @property
    def attention_tp(self) -> int:
        """Ranks that split one copy of the attention heads and their KV."""
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def dp_meaning(self) -> str:
        if self.dp == 1:
            return "none"
        return "attention groups" if self.dp_attention else "replicas"


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

    @property
    def total_tokens_per_rank(self) -> int:
        return self.device_tokens_per_rank + self.host.tokens_per_rank

    @property
    def device_concurrency(self) -> int:
        """Requests running at once: each data-parallel replica (or attention group) runs its
        own, from a pool that holds only its requests' KV."""
        return self.device_tokens_per_rank // self.inputs.workload.avg_seq_len * self.inputs.dp

    @property
    def cached_concurrency(self) -> int:
        return self.total_tokens_per_rank // self.inputs.workload.avg_seq_len * self.inputs.dp

    @property
    def longest_request(self) -> int:
        """Tokens of the longest request the device pool holds (all of its KV on the device)."""
        return self.device_tokens_per_rank

    def to_dict(self) -> dict[str, Any]:
        """The numbers; the verdict and the launch lines add theirs (plan/render.py)."""
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
        "dp_attention": inputs.dp_attention,
        "dp_meaning": inputs.dp_meaning,
        "attention_tp": inputs.attention_tp,
        "context_length": inputs.context_length,
        "avg_seq_len": inputs.workload.avg_seq_len,
        "wanted_concurrency": inputs.workload.concurrency,
        "weights_bytes": inputs.model.weight_bytes,
        "weights_note": inputs.model.weight_note,
        "draft": _draft_dict(inputs),
    }


def _draft_dict(inputs: PlanInputs) -> dict[str, Any] | None:
    draft = inputs.draft
    if draft is None:
        return None
    return {
        **dataclasses.asdict(draft),
        "bytes_per_rank": draft.bytes_per_rank(inputs.tp),
        "verify_bytes_per_request": draft.verify_bytes(inputs.model.config.vocab_size),
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
        "longest_request_tokens": plan.longest_request,
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
    if inputs.dp_attention:  # the attention side split over its group only
        attention = inputs.model.attention_bytes
        attention += inputs.model.dense_mlp_bytes if inputs.dense_per_group else 0
        rank_weights = weights_per_rank(
            inputs.model.weight_bytes - attention, inputs.tp * inputs.pp
        )
        rank_weights += weights_per_rank(attention, inputs.attention_tp * inputs.pp)
    if inputs.draft is not None:  # on the last stage only; every stage is planned alike
        rank_weights += inputs.draft.bytes_per_rank(inputs.tp)
    if inputs.device_tokens_per_rank is not None:
        tokens = inputs.device_tokens_per_rank
        return rank_weights, tokens * bytes_per_token, tokens
    gpu = inputs.machine.gpu_memory  # a card with nothing on it yet: all of it free
    pool = device_pool_bytes(gpu, gpu, rank_weights, inputs.mem_fraction_static)
    return rank_weights, pool, tokens_in(pool, bytes_per_token, inputs.page_size)


def make_plan(inputs: PlanInputs) -> Plan:
    """Everything `tierserve plan` prints, computed once."""
    # A pipeline stage holds its share of the layers, and their KV.
    cfg = inputs.model.config
    stage = dataclasses.replace(cfg, num_layers=math.ceil(cfg.num_layers / inputs.pp))
    if inputs.draft is not None:  # its KV: one more layer of the target's shape
        stage = dataclasses.replace(stage, num_layers=stage.num_layers + 1)
    spec = kv_spec(stage, inputs.kv_dtype, inputs.attention_tp, inputs.page_size)
    kv = _kv_for(inputs, spec)
    ranks = local_ranks(inputs.processes, inputs.gpus_per_node)
    rank_weights, pool, device = _device_side(inputs, kv.per_rank)
    budget = host_budget(inputs.machine, ranks)
    host = size_host_cache(kv.per_rank, device, inputs.host, budget, inputs.page_size)
    host_args = (kv.per_rank, device, HostRequest.auto(), budget, inputs.page_size)
    best = size_host_cache(*host_args)
    return Plan(
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
    )


def draft_figures(plan: Plan) -> tuple[int, int, int]:
    """The draft's weights per rank, its KV layer's bytes of each token's per rank, and one
    running request's verify logits."""
    draft = plan.inputs.draft
    assert draft is not None
    layer = plan.kv.per_rank // plan.spec.num_layers
    verify = draft.verify_bytes(plan.inputs.model.config.vocab_size)
    return draft.bytes_per_rank(plan.inputs.tp), layer, verify


def draft_lines(plan: Plan) -> list[str]:
    """What a speculative line's draft adds, for the checks' explanations."""
    draft = plan.inputs.draft
    if draft is None:
        return []
    weights, layer, verify = draft_figures(plan)
    return [
        f"{draft.name}: {format_gb(weights)} of weights per rank "
        f"({draft.placement}, {draft.source}) in the weights; its KV one more layer, "
        f"{format_bytes(layer)} of each token's {format_bytes(plan.kv.per_rank)}; verify "
        f"logits {format_bytes(verify)} per running request ({draft.tokens_per_step} rows)"
    ]


def kv_dtype_flag(plan: Plan, fp8: str) -> str:
    return f" --kv-cache-dtype {fp8}" if plan.inputs.kv_dtype == "fp8" else ""
