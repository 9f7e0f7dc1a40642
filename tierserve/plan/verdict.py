"""The constraints a plan must meet, each with its arithmetic and what to change when it fails.

A plan fits only when every constraint holds; the verdict names the ones that do not. The
constraints are the ones a launch runs into: the device pool must exist (weights leave room in
GPU memory × mem-fraction-static) and hold what was asked of it; the node's RAM must hold the
server processes and every host pool; a request of the context length asked for must fit on the
device (a running request's KV is all on the device: the host tier does not change that); and the
requests wanted at once must fit on the device too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tierserve.plan.plan import Plan, make_plan
from tierserve.sizing import kv_dtype_name
from tierserve.utils import DTYPES, GB, format_count, format_gb


@dataclass(frozen=True)
class Constraint:
    name: str  # "device memory", "host RAM", "context length", "concurrency"
    holds: bool
    arithmetic: str  # the numbers, as a reader can check them
    fix: str = ""  # what to change when it does not hold (never a zero size)
    # The fix as numbers, for programs: flag name (as a field) → the value that would hold.
    suggest: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """What a plan is worth: the constraints it meets or fails, and what to beware of."""

    plan: Plan
    constraints: tuple[Constraint, ...]
    warnings: tuple[str, ...]

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "constraints": [dataclasses.asdict(c) for c in self.constraints],
            "failed": [c.name for c in self.failed],
            "warnings": list(self.warnings),
        }


def judge(plan: Plan) -> Verdict:
    return Verdict(plan, constraints(plan), plan_warnings(plan))


def constraints(plan: Plan) -> tuple[Constraint, ...]:
    checks = [_device_memory(plan), _host_ram(plan)]
    if plan.inputs.context_length is not None:
        checks.append(_context_length(plan))
    if plan.inputs.workload.concurrency is not None:
        checks.append(_concurrency(plan))
    return tuple(checks)


def _static(plan: Plan) -> int:
    inputs = plan.inputs
    return int(inputs.machine.gpu_memory * inputs.mem_fraction_static)


def _tp_needed(plan: Plan) -> int:
    """The smallest tp whose weights per rank leave at least a quarter of the static share."""
    inputs, static = plan.inputs, _static(plan)
    total = plan.weights_bytes_per_rank * inputs.tp * inputs.pp
    return max(inputs.tp + 1, math.ceil(total / (0.75 * static)) if static else inputs.tp + 1)


def _more_gpus(plan: Plan) -> str:
    return (
        f"spread the weights over more GPUs (about --tp {_tp_needed(plan)}), use a quantized "
        "checkpoint, or raise --mem-fraction-static"
    )


def _device_memory(plan: Plan) -> Constraint:
    inputs, static = plan.inputs, _static(plan)
    weights = plan.weights_bytes_per_rank
    share = (
        f"GPU {format_gb(inputs.machine.gpu_memory)} × mem-fraction-static "
        f"{inputs.mem_fraction_static:g} = {format_gb(static)}"
    )
    if inputs.device_tokens_per_rank is not None:
        need = plan.device_pool_bytes_per_rank + weights
        arithmetic = (
            f"--max-total-tokens {format_count(inputs.device_tokens_per_rank)} × "
            f"{format_count(plan.kv.per_rank)} B = {format_gb(plan.device_pool_bytes_per_rank)} "
            f"+ weights {format_gb(weights)} = {format_gb(need)} "
            f"{'≤' if need <= static else '>'} {share}"
        )
        if need <= static:
            return Constraint("device memory", True, arithmetic)
        most = max(0, static - weights) // plan.kv.per_rank
        most -= most % inputs.page_size  # whole pages
        if most >= inputs.page_size:
            fix, suggest = f"at most --max-total-tokens {format_count(most)} fits", most
            return Constraint(
                "device memory", need <= static, arithmetic, fix, {"max_total_tokens": suggest}
            )
        fix, tp = _more_gpus(plan), _tp_needed(plan)
        return Constraint("device memory", need <= static, arithmetic, fix, {"tp": tp})
    holds = plan.device_tokens_per_rank > 0
    relation = "<" if holds else "≥"
    arithmetic = f"weights per rank {format_gb(weights)} {relation} {share}"
    if holds:
        arithmetic += (
            f": KV pool {format_gb(plan.device_pool_bytes_per_rank)} = "
            f"{format_count(plan.device_tokens_per_rank)} tokens"
        )
    else:
        arithmetic += ": no room for a KV pool"
    if holds:
        return Constraint("device memory", True, arithmetic)
    return Constraint(
        "device memory", False, arithmetic, _more_gpus(plan), {"tp": _tp_needed(plan)}
    )


def _host_ram(plan: Plan) -> Constraint:
    budget, host = plan.budget, plan.host
    processes = (
        f"{format_gb(budget.available)} available − {format_gb(budget.overhead)} for "
        f"{budget.local_ranks} server processes − {format_gb(budget.margin)} margin"
    )
    if budget.overhead + budget.margin > budget.available:
        arithmetic = f"{processes} < 0: the processes alone do not fit"
        fix = "a node with more free RAM, or fewer processes per node"
        return Constraint("host RAM", False, arithmetic, fix)
    if host.mode == "off":
        return Constraint("host RAM", True, f"no host cache; {processes} ≥ 0")
    need = host.bytes_per_node
    arithmetic = (
        f"{budget.local_ranks} host pools × {format_gb(host.bytes_per_rank)} = "
        f"{format_gb(need)} {'≤' if host.fits else '>'} {processes} = {format_gb(budget.usable)}"
    )
    if host.fits:
        return Constraint("host RAM", True, arithmetic)
    best = plan.recommended
    if best.bytes_per_rank == 0:
        fix = "no host cache fits here: run without one (--no-host-cache)"
        return Constraint("host RAM", False, arithmetic, fix)
    fix = (
        f"at most {format_gb(best.bytes_per_rank)} per rank "
        f"({format_gb(best.bytes_per_node)} per node) fits"
    )
    suggest = {
        "host_bytes_per_rank": best.bytes_per_rank,
        "host_bytes_per_node": best.bytes_per_node,
    }
    return Constraint("host RAM", False, arithmetic, fix, suggest)


def _context_length(plan: Plan) -> Constraint:
    length, tokens = plan.inputs.context_length or 0, plan.device_tokens_per_rank
    holds = 0 < length <= tokens
    arithmetic = (
        f"a request of --context-length {format_count(length)} tokens "
        f"{'≤' if holds else '>'} device pool {format_count(tokens)} tokens (a running request's "
        "KV is all on the device; a host tier does not change that)"
    )
    if holds:
        return Constraint("context length", True, arithmetic)
    fix = f"--context-length {format_count(tokens)} at most, or more device memory"
    suggest = {"context_length": tokens} if tokens else {}
    return Constraint("context length", False, arithmetic, fix, suggest)


def _concurrency(plan: Plan) -> Constraint:
    wanted, dp = plan.inputs.workload.concurrency or 0, plan.inputs.dp
    length, tokens = plan.inputs.workload.avg_seq_len, plan.device_tokens_per_rank * dp
    holds = wanted * length <= tokens
    pool = f"{dp} replicas × device pool" if dp > 1 else "device pool"
    arithmetic = (
        f"{wanted} requests × {format_count(length)} tokens = {format_count(wanted * length)} "
        f"{'≤' if holds else '>'} {pool} {format_count(tokens)} tokens: "
        f"{plan.device_concurrency} run at once"
    )
    if not holds and plan.cached_concurrency > plan.device_concurrency:
        arithmetic += (
            f"; device + host keep the KV of {plan.cached_concurrency} cached, so the others "
            "wait without losing their prefixes"
        )
    if holds:
        return Constraint("concurrency", True, arithmetic)
    running = plan.device_concurrency
    suggest = {"max_running_requests": running} if running else {}
    return Constraint("concurrency", False, arithmetic, _concurrency_levers(plan), suggest)


def _concurrency_levers(plan: Plan) -> str:
    """What raises the requests running at once (a host tier does not: a running request's KV is
    all on the device), each with what it would give."""
    inputs, tokens = plan.inputs, plan.device_tokens_per_rank
    length = inputs.workload.avg_seq_len
    levers = []
    width = DTYPES[kv_dtype_name(inputs.kv_dtype)].bytes
    if width > 1:
        more = tokens * width
        levers.append(
            f"fp8 KV (--kv-dtype fp8): {format_count(more)} tokens, {more // length} requests"
        )
    if plan.spec.kind == "latent" and inputs.tp > 1 and not inputs.dp_attention:
        levers.append(_dp_attention_lever(plan))
    levers.append("more GPUs (--tp) or a higher --mem-fraction-static")
    return "; ".join(levers) + " (a host tier does not raise it)"


def _dp_attention_lever(plan: Plan) -> str:
    """DP attention at dp = tp, planned: each rank keeps only its own requests' latents, but
    also the attention weights whole, which the pool pays for."""
    tp = plan.inputs.tp
    groups = make_plan(dataclasses.replace(plan.inputs, dp=tp, dp_attention=True))
    flags = f"--enable-dp-attention --dp {tp}"
    tokens = groups.device_tokens_per_rank
    if tokens == 0:
        return (
            f"not {flags}: each rank would keep the attention weights whole "
            f"({format_gb(groups.weights_bytes_per_rank)} per rank), leaving no KV pool"
        )
    return (
        f"{flags} (SGLang's DP attention): each rank keeps only its own requests' latents, "
        f"{tp} × {format_count(tokens)} = {format_count(tokens * tp)} tokens, "
        f"{format_count(groups.device_concurrency)} requests"
    )


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
