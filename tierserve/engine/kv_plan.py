"""Start-up sizing of the host tier, with the planner's arithmetic, checked before allocating.

The check is on the node total of every local rank, never on one rank alone (SGLang's trap:
each rank checks free RAM by itself, and 8 × 300 GB hung a 449 GB machine). With tensor
parallelism rank 0 sizes for all of the node's ranks at once and every rank takes its sizes
(distributed/ranks.py), so the node is checked once, by one process.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import psutil

from tierserve.args import EngineArgs
from tierserve.errors import TierserveError
from tierserve.sizing import (
    DEFAULT_MARGIN,
    DraftSize,
    HostBudget,
    HostSizing,
    KVSpec,
    host_request,
    size_host_cache,
)
from tierserve.utils import format_bytes, format_count, format_gb

SHARED_MEMORY_DIR = "/dev/shm"


def size_host_tier(
    args: EngineArgs,
    spec: KVSpec,
    device_tokens: int,
    overhead: int,
    available: int | None = None,
) -> HostSizing:
    """The host tier for this rank; raises with the arithmetic when the node would not fit."""
    budget = HostBudget(
        available=psutil.virtual_memory().available if available is None else available,
        overhead=overhead,
        margin=DEFAULT_MARGIN,
        local_ranks=args.local_ranks,
    )
    request = host_request(args.hicache_node_size, args.hicache_size, args.hicache_ratio)
    sharing = 1 if args.disable_shared_host_copy else spec.host_sharing(args.local_ranks)
    sizing = size_host_cache(
        spec.bytes_per_token, device_tokens, request, budget, spec.page_size, sharing
    )
    requested = sizing.bytes_per_node
    if requested > budget.usable or sizing.tokens_per_rank < args.page_size:
        message = refusal(sizing, budget, requested, args.page_size)
        raise TierserveError(message, field="hicache_size")
    if sharing > 1:
        check_shared_memory(requested)
    return sizing


def check_shared_memory(node_bytes: int, path: str = SHARED_MEMORY_DIR) -> None:
    """Shared host copies live in /dev/shm (tmpfs, RAM): its size limit (64 MB in a default
    container) must hold them, or writing a page would fail with SIGBUS mid-serving."""
    free = shutil.disk_usage(path).free
    if node_bytes > free:
        raise TierserveError(
            f"the shared host copies need {format_gb(node_bytes, 3)} in {path}, which has "
            f"{format_gb(free, 3)} free: enlarge it (docker run --shm-size), lower --hicache-size, "
            "or use --disable-shared-host-copy",
            field="hicache_size",
        )


def check_cpu_ram(
    plan: KVPlan, weight_bytes: int, available: int | None = None, local_ranks: int = 1
) -> None:
    """On CPU the "device" pool, its decode workspace, a draft's verify logits and the weights
    are RAM: refuse, with the arithmetic and the largest pool that fits, what would fail in an
    allocation later. Each local rank has its own pool and workspace; the weights are split
    among them. `weight_bytes` includes a draft's, which is named when it is what does not fit."""
    available = psutil.virtual_memory().available if available is None else available
    usable = available - DEFAULT_MARGIN
    verify = plan.verify_bytes * local_ranks
    need = (plan.device_bytes + plan.workspace_bytes) * local_ranks + verify + weight_bytes
    if need <= usable:
        return
    draft, of_draft = plan.draft, ""
    if draft is not None:
        draft_bytes = draft.bytes_per_node(local_ranks)
        of_draft = f" (the {draft.name}'s {format_gb(draft_bytes)} of them)"
        if weight_bytes + verify > usable and weight_bytes - draft_bytes <= usable:
            raise TierserveError(
                f"the {draft.name} does not fit in RAM: {format_gb(draft_bytes)} "
                f"({draft.placement}) + {format_gb(weight_bytes - draft_bytes)} of the model's "
                f"weights + {format_gb(verify)} verify logits = {format_gb(weight_bytes + verify)} "
                f"> {format_gb(available)} available − {format_gb(DEFAULT_MARGIN)} margin = "
                f"{format_gb(usable)}, before any KV pool",
                field="speculative_draft_model_path",
            )
    per_token = (plan.device_bytes + plan.workspace_bytes) * local_ranks // plan.device_tokens
    room = (usable - weight_bytes - verify) // per_token
    room = max(0, room // plan.spec.page_size * plan.spec.page_size)
    beside = f" + {format_gb(verify)} verify logits" if verify else ""
    raise TierserveError(
        f"the device KV pool does not fit in RAM: {format_count(plan.device_tokens)} tokens × "
        f"{format_bytes(per_token)} (pool + decode workspace{_of_ranks(local_ranks)}) + "
        f"{format_gb(weight_bytes)} weights{of_draft}{beside} = {format_gb(need)} > "
        f"{format_gb(available)} available − {format_gb(DEFAULT_MARGIN)} margin = "
        f"{format_gb(usable)}: use --max-total-tokens {room} or less",
        field="max_total_tokens",
    )


def _of_ranks(local_ranks: int) -> str:
    return f", {local_ranks} local ranks" if local_ranks > 1 else ""


def refusal(sizing: HostSizing, budget: HostBudget, requested: int, page_size: int) -> str:
    ranks = budget.local_ranks
    if requested <= budget.usable:  # it fits; it holds less than a page
        return (
            f"host cache too small: {format_gb(sizing.bytes_per_rank)} per rank holds "
            f"{sizing.tokens_per_rank} tokens, less than one page of {page_size}: give a larger "
            "--hicache-size or --hicache-ratio, or drop --enable-hierarchical-cache"
        )
    most = budget.max_bytes_per_rank
    shared = f" (one copy per {sizing.sharing} ranks)" if sizing.sharing > 1 else ""
    if most <= 0:  # no host cache size helps: what the overhead counts must shrink
        return (
            f"host cache does not fit: {format_gb(budget.available)} available − "
            f"{format_gb(budget.overhead)} overhead − {format_gb(budget.margin)} margin leaves "
            "nothing for it. The overhead is this process's pools and weights on CPU, and a "
            "store's client RAM and buffers (write_queue_bytes, batch_pages): shrink those, or "
            "drop --enable-hierarchical-cache"
        )
    return (
        f"host cache does not fit: {ranks} rank(s) × {format_gb(sizing.bytes_per_rank)}{shared} = "
        f"{format_gb(requested)} requested; {format_gb(budget.available)} available − "
        f"{format_gb(budget.overhead)} overhead − {format_gb(budget.margin)} margin = "
        f"{format_gb(budget.usable)} usable: use --hicache-size {most / 1e9:.1f} (per rank) or "
        f"--hicache-node-size {most * ranks / 1e9:.1f}GB (per node), or --hicache-size auto"
    )


@dataclass(frozen=True)
class KVPlan:
    """What the engine allocates for KV, decided before anything is: the one spec every pool is
    built from, the pool sizes, and the memory beside them that the plan counts."""

    spec: KVSpec
    device_tokens: int
    host: HostSizing | None
    write_policy: str
    workspace_bytes: int = 0  # CPU decode workspace, at most (layers/attention.py)
    storage_ram_bytes: int = 0  # a storage client's RAM on this node (Mooncake's segment)
    # A draft model (an EAGLE-3 draft, an MTP layer): its weights (counted in the RAM checks
    # with the target's), its KV layers, the spec's last (in every bytes-per-token figure),
    # and the verify logits of the running requests (RAM on CPU; activations on a GPU).
    draft: DraftSize | None = None
    verify_bytes: int = 0
    weight_bytes_per_rank: int = 0  # a quantized weight's as its backend keeps it
    quantization: str = ""  # a quantized checkpoint's schemes and their backends

    @property
    def device_bytes(self) -> int:
        return self.device_tokens * self.spec.bytes_per_token


def _sharing_rows(sizing: HostSizing) -> list[tuple[str, str]]:
    if sizing.sharing == 1:
        return []
    alone = sizing.tokens_per_rank // sizing.sharing
    return [
        (
            "shared host copy",
            f"one per {sizing.sharing} ranks holding identical KV, "
            f"{format_gb(sizing.pool_bytes, 3)} each (in {SHARED_MEMORY_DIR})",
        ),
        (
            "host tokens, shared vs per-rank copies",
            f"{format_count(sizing.tokens_per_rank)} vs {format_count(alone)} at the same bytes",
        ),
    ]


def startup_table(
    plan: KVPlan, dp_groups: int = 1, placement: str | None = None, omp_wait: str | None = None
) -> str:
    """The sizes (and, from the node's first process, where its ranks compute and how their
    OpenMP threads wait: `distributed.describe_wait` of the engine's environment)."""
    spec = plan.spec
    rows = [
        *(
            [("weights per rank", format_gb(plan.weight_bytes_per_rank, 3))]
            if plan.weight_bytes_per_rank
            else []
        ),
        *([("quantized weights", plan.quantization)] if plan.quantization else []),
        ("KV bytes per token per rank", format_bytes(spec.bytes_per_token)),
        ("KV page", f"{spec.page_size} tokens, {format_bytes(spec.bytes_per_page)}"),
        ("device pool tokens per rank", format_count(plan.device_tokens)),
        ("device pool bytes per rank", format_gb(plan.device_bytes, 3)),
    ]
    if dp_groups > 1:
        distinct = format_count(plan.device_tokens * dp_groups)
        rows.append(
            (
                "attention groups (DP)",
                f"{dp_groups}, each pool its own group's requests: {distinct} distinct device "
                "tokens on the node",
            )
        )
    if plan.workspace_bytes:
        rows.append(("decode workspace, at most", format_gb(plan.workspace_bytes, 3)))
    sizing = plan.host
    if sizing is not None:
        rows += [
            ("host tier tokens per rank", format_count(sizing.tokens_per_rank)),
            ("host tier bytes per rank", format_gb(sizing.bytes_per_rank, 3)),
            ("host tier bytes per node", format_gb(sizing.bytes_per_node, 3)),
            *_sharing_rows(sizing),
            ("host budget", sizing.formula),
            ("write policy", plan.write_policy),
        ]
    if plan.storage_ram_bytes:
        rows.append(("storage client RAM", format_gb(plan.storage_ram_bytes, 3)))
    draft = plan.draft
    if draft is not None:
        per_token = spec.bytes_per_token // spec.num_layers * draft.kv_layers
        weights = format_gb(draft.weight_bytes, 3)
        rows.append(
            (draft.name, f"{weights} of weights ({draft.placement}); its KV layer "
             f"{format_bytes(per_token)} of each token's (counted above); verify logits "
             f"{format_gb(plan.verify_bytes, 3)} at the running cap")
        )  # fmt: skip
    if placement is not None:
        rows.append(("CPU placement", placement))
        rows.append(("OpenMP waiting", omp_wait or ""))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
