"""What `tierserve plan` prints: the plan's tables, its verdict, its launch lines, and the
checks of SGLang's and vLLM's command lines; as text, or as the JSON of `--json`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tierserve.plan.launch import launch_flags
from tierserve.plan.plan import Plan, draft_figures
from tierserve.plan.sglang import SGLangCheck
from tierserve.plan.verdict import Verdict
from tierserve.plan.vllm import VLLMCheck
from tierserve.utils import format_bytes, format_count, format_gb

Row = tuple[str, str, str]


def _table(sections: list[tuple[str, list[Row]]]) -> list[str]:
    lines = []
    for title, rows in sections:
        lines.append(title)
        lines += [f"  {label:<26}{value:>16}   {note}".rstrip() for label, value, note in rows]
        lines.append("")
    return lines


def _kv_note(plan: Plan) -> str:
    kv, tp, dp = plan.inputs.model.config, plan.inputs.attention_tp, plan.inputs.dp
    if plan.inputs.dp_attention:
        held = "latents" if plan.spec.kind == "latent" else "KV"
        group = f"{tp} rank{'s' if tp > 1 else ''}"
        return f"each of {dp} attention groups ({group}) holds only its own requests' {held}"
    if plan.spec.kind == "latent":
        return f"MLA latent: not split, identical on all {tp} ranks" if tp > 1 else "MLA latent"
    if plan.kv.replicated:
        return (
            f"{kv.num_kv_heads} KV heads < tp {tp}: 1 head per rank, each on {plan.kv_copies} ranks"
        )
    return (
        f"{kv.num_kv_heads} KV heads split over {tp} ranks"
        if tp > 1
        else f"{kv.num_kv_heads} KV heads"
    )


def _device_rows(plan: Plan) -> list[Row]:
    inputs = plan.inputs
    gpu, frac = inputs.machine.gpu_memory, inputs.mem_fraction_static
    static = int(gpu * frac)
    length = format_count(inputs.workload.avg_seq_len)
    pool_note = f"= {format_gb(static)} − {format_gb(plan.weights_bytes_per_rank)}"
    if inputs.device_tokens_per_rank is not None:
        pool_note = "--max-total-tokens given; memory formula not used"
    weights_note = f"{inputs.model.weight_note} / {inputs.tp} ranks"
    if inputs.dp_attention:
        attention = format_gb(inputs.model.attention_bytes)
        weights_note += f"; attention + embeddings ({attention}) / {inputs.attention_tp} per group"
    running = "decoding at once"
    if inputs.dp > 1:
        each = plan.device_concurrency // inputs.dp
        running += f": {inputs.dp} {inputs.dp_meaning} × {format_count(each)}"
    return [
        ("weights", format_gb(plan.weights_bytes_per_rank), weights_note),
        *_draft_rows(plan),
        ("GPU × mem-fraction-static", format_gb(static), f"{format_gb(gpu)} × {frac:g}"),
        ("KV pool", format_gb(plan.device_pool_bytes_per_rank), pool_note),
        (
            "tokens",
            format_count(plan.device_tokens_per_rank),
            f"pool // {format_bytes(plan.kv.per_rank)}",
        ),
        (f"requests of {length} tokens", format_count(plan.device_concurrency), running),
    ]


def _draft_rows(plan: Plan) -> list[Row]:
    """The draft's share of the weights above, its KV layer's share of each token's bytes, and
    the verify step's logits (activations, beside the static fraction)."""
    draft = plan.inputs.draft
    if draft is None:
        return []
    weights, layer, verify = draft_figures(plan)
    return [
        (f"  of which {draft.name}", format_gb(weights), f"{draft.source}, {draft.placement}"),
        ("  its KV layer", format_bytes(layer), "per token, in the tokens' bytes below"),
        ("  verify logits", format_bytes(verify),
         f"per running request: {draft.tokens_per_step} rows × vocabulary × 4 B"),
    ]  # fmt: skip


def _host_rows(plan: Plan) -> list[Row]:
    budget, best, host = plan.budget, plan.recommended, plan.host
    usable_note = (
        f"= {format_gb(budget.available)} available − {format_gb(budget.overhead)} overhead "
        f"− {format_gb(budget.margin)} margin"
    )
    store = plan.inputs.machine.storage_ram_per_process
    if store:
        usable_note += f" (overhead incl. {budget.local_ranks} × {format_gb(store)} storage client)"
    rows = [
        ("usable on the node", format_gb(budget.usable), usable_note),
        ("recommended per rank", format_gb(best.bytes_per_rank), _per_rank_note(plan)),
        ("recommended per node", format_gb(best.bytes_per_node), f"× {plan.local_ranks} ranks"),
        ("host tokens per rank", format_count(best.tokens_per_rank), "at the recommended size"),
    ]
    if host.mode == "auto":
        return rows
    verdict = "fits" if host.fits else "DOES NOT FIT"
    sizes = f"{format_gb(host.bytes_per_rank)}/rank, {format_gb(host.bytes_per_node)}/node"
    requested = f"{plan.inputs.host.describe()}: {sizes}, {verdict}"
    return [*rows, ("requested host tokens", format_count(host.tokens_per_rank), requested)]


def _per_rank_note(plan: Plan) -> str:
    budget = plan.budget
    return f"= {format_gb(budget.usable)} / {budget.local_ranks} local ranks, rounded down"


def _total_rows(plan: Plan) -> list[Row]:
    length = format_count(plan.inputs.workload.avg_seq_len)
    mode = "recommended" if plan.host.mode == "auto" else "requested"
    return [
        ("tokens per rank", format_count(plan.total_tokens_per_rank), f"device + {mode} host"),
        (
            f"requests of {length} tokens",
            format_count(plan.cached_concurrency),
            "whose KV stays cached (device + host)",
        ),
    ]


def _header(plan: Plan) -> str:
    inputs, machine = plan.inputs, plan.inputs.machine
    gpus = f"{plan.local_ranks} × {machine.gpu_name} ({format_gb(machine.gpu_memory)} each)"
    nodes = f" on {plan.nodes} nodes" if plan.nodes > 1 else ""
    dp = ""
    if inputs.dp_attention:
        dp = f", DP attention {inputs.dp} (--dp as attention groups of {inputs.attention_tp})"
    elif inputs.dp > 1:
        dp = f", DP {inputs.dp} (--dp as replicas: add --enable-dp-attention for groups)"
    return (
        f"tierserve plan: {inputs.model.name} ({inputs.model.config.attention}), "
        f"KV {inputs.kv_dtype}, TP {inputs.tp}{dp}{nodes}, {gpus}, "
        f"mem-fraction-static {inputs.mem_fraction_static:g}\n"
        f"host RAM: {format_gb(machine.host_available)} available ({machine.host_source})\n"
    )


def plan_json(verdict: Verdict) -> dict[str, Any]:
    """`tierserve plan --json`: the plan's numbers, its verdict and its launch lines."""
    flags = dataclasses.asdict(launch_flags(verdict))
    return {**verdict.plan.to_dict(), **verdict.to_dict(), "flags": flags}


def render_plan(verdict: Verdict) -> str:
    plan = verdict.plan
    kv_rows: list[Row] = [
        ("whole model", format_bytes(plan.kv.total), f"one copy, {plan.inputs.kv_dtype}"),
        ("per rank", format_bytes(plan.kv.per_rank), _kv_note(plan)),
    ]
    sections = [
        ("KV bytes per token", kv_rows),
        ("Device pool, per rank", _device_rows(plan)),
        ("Host cache", _host_rows(plan)),
        ("Total", _total_rows(plan)),
    ]
    lines = [_header(plan), *_table(sections), *_measured_note(plan), *_verdict_lines(verdict)]
    lines += ["", "Launch flags", *_flag_lines(verdict)]
    if verdict.warnings:
        lines += ["", "Warnings", *(f"  - {w}" for w in verdict.warnings)]
    return "\n".join(lines)


def _measured_note(plan: Plan) -> list[str]:
    """The formula's pool is an upper bound: say so, with the one measurement we have."""
    if plan.inputs.device_tokens_per_rank is not None:
        return []  # a measured (or chosen) pool was given
    return [
        "Measured pools can be smaller than this formula's: a server's pool is what its memory",
        "profiler leaves after the weights, CUDA graphs, communication buffers and activations,",
        "and its bytes per token can exceed the formula's. The seed's SGLang server (Kimi-K2.5,",
        "8 × RTX PRO 6000, --mem-fraction-static 0.93) logged ~116-127K device tokens at 136,793 B",
        "per token per GPU where this plan computes 301,840 at 70,272 B; its logs do not say what",
        "the other bytes are. Give a server's logged figures with --kv-bytes-per-token and",
        "--max-total-tokens to plan from them.",
        "",
    ]


def _verdict_lines(verdict: Verdict) -> list[str]:
    plan = verdict.plan
    lines = ["Constraints"]
    for c in verdict.constraints:
        lines.append(f"  {'ok  ' if c.holds else 'FAIL'} {c.name}: {c.arithmetic}")
        if c.fix:
            lines.append(f"       instead: {c.fix}")
    if plan.inputs.context_length is None:
        lines.append(
            f"  longest request the device pool holds: {format_count(plan.longest_request)} "
            "tokens (SGLang starts and caps requests at it; vLLM refuses a max_model_len above "
            "it; give --context-length to check one)"
        )
    names = ", ".join(c.name for c in verdict.failed)
    lines += ["", "fits: yes" if verdict.fits else f"fits: NO ({names})"]
    return lines


def _flag_lines(verdict: Verdict) -> list[str]:
    if not verdict.launchable:
        return ["  none: a server would not start on this machine (see Constraints)"]
    plan, flags = verdict.plan, launch_flags(verdict)
    path = plan.inputs.model.path or plan.inputs.model.name
    local, fetch = path, []
    if not Path(path).is_dir():  # a preset: serve loads a local directory, never the hub
        local = f"./{path.rsplit('/', 1)[-1]}"
        fetch = [f"    first: huggingface-cli download {path} --local-dir {local}"]
    return [
        f"  tierserve serve --model {local} {flags.tierserve}",
        *fetch,
        "    --hicache-node-size: all local ranks together (--hicache-size would be per rank)",
        f"  python -m sglang.launch_server --model-path {path} {flags.sglang}",
        "    --hicache-size: decimal GB PER RANK; --hicache-ratio: × each rank's device pool",
        f"  vllm serve {path} {flags.vllm}",
        "    --gpu-memory-utilization also covers activations (vLLM's KV pool comes out smaller);",
        "    --kv-offloading-size: GiB for the whole instance, split across its TP ranks",
    ]


def render_check(check: SGLangCheck | VLLMCheck) -> str:
    verdict = "fits" if check.fits else "DOES NOT FIT"
    plan, engine = check.plan, "vllm" if isinstance(check, VLLMCheck) else "sglang"
    lines = [
        f"tierserve plan --check-{engine}: {verdict}",
        f"  model {plan.inputs.model.name}: {format_bytes(plan.kv.per_rank)} of KV per token "
        f"per rank, device pool {format_count(plan.device_tokens_per_rank)} tokens per rank",
        *(f"  {line}" for line in check.lines),
    ]
    return "\n".join(lines)
