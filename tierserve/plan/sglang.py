"""`tierserve plan --check-sglang`: what an SGLang command line asks of a machine.

SGLang's semantics, read from its source (0.5.x): every TP rank of every pipeline stage is a
process that allocates its own host pool; `--hicache-size` is decimal GB per rank (an int; 0
means "use the ratio"), else host tokens = that rank's device tokens × `--hicache-ratio`. What
SGLang itself then does with a node that cannot hold the pools changed between releases
(sglang_versions.py): before v0.5.19 each rank checks alone and the node hangs; since then it
refuses at start-up; since v0.5.21 it sizes the pools itself when no size or ratio is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
from dataclasses import dataclass
from typing import Any

from tierserve.args import check_mem_fraction, ranks_per_node
from tierserve.errors import TierserveError
from tierserve.plan.draft import draft_size
from tierserve.plan.misspelt import refuse_misspelt
from tierserve.plan.plan import Plan, PlanInputs, draft_lines, kv_dtype_flag, make_plan
from tierserve.plan.sglang_versions import (
    DEFAULT_FRACTION,
    DEFAULT_RATIO,
    NEWEST,
    SGLangVersion,
    auto_ratio,
    own_check_line,
)
from tierserve.plan.verdict import judge
from tierserve.sizing import HostRequest, HostSizing, short_kv_dtype
from tierserve.utils import GB, format_bytes, format_count, format_gb

# SGLang rounds a host pool down to whole pages, then adds one.
SGLANG_EXTRA_PAGES = 1


@dataclass(frozen=True)
class SGLangFlags:
    """The part of an SGLang command line that decides memory, with SGLang's defaults."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    nnodes: int = 1
    dp_attention: bool = False
    hierarchical: bool = False
    hicache_size_gb: int = 0  # SGLang: int, decimal GB, per rank; 0 = use the ratio
    hicache_ratio: float | None = None  # None: not given (SGLang's default ratio, 2)
    hicache_host_memory_fraction: float | None = None  # v0.5.21+: None is SGLang's 0.8
    page_size: int = 1
    mem_fraction_static: float | None = None  # None: SGLang picks one from the GPU size
    kv_cache_dtype: str | None = None
    max_total_tokens: int | None = None
    model_path: str | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None

    @property
    def local_ranks(self) -> int:
        # Every rank is a process with its own host pool: each pipeline stage is tp more of
        # them, and DP without DP-attention adds whole TP × PP groups.
        groups = 1 if self.dp_attention else self.dp
        return ranks_per_node(self.tp * self.pp * groups, self.nnodes, "SGLang's tp × pp × dp =")


def _sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--tp-size", "--tp", dest="tp", type=int, default=1)
    add("--pp-size", "--pp", dest="pp", type=int, default=1)
    add("--dp-size", "--dp", dest="dp", type=int, default=1)
    add("--nnodes", type=int, default=1)
    add("--enable-dp-attention", dest="dp_attention", action="store_true")
    add("--enable-hierarchical-cache", dest="hierarchical", action="store_true")
    add("--hicache-size", dest="hicache_size_gb", type=int, default=0)
    add("--hicache-ratio", type=float, default=None)
    add("--hicache-host-memory-fraction", type=float, default=None)
    add("--page-size", type=int, default=1)
    add("--mem-fraction-static", type=float, default=None)
    add("--kv-cache-dtype", default=None)
    add("--max-total-tokens", type=int, default=None)
    add("--model-path", "--model", dest="model_path", default=None)
    add("--speculative-algorithm", default=None)
    add("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    add("--speculative-num-steps", type=int, default=None)
    return parser


def parse_sglang_flags(flags: str) -> SGLangFlags:
    """Read an SGLang command line (a whole `python -m sglang.launch_server …` line is fine);
    flags that do not affect memory are ignored."""
    try:
        words = shlex.split(flags.replace("\\\n", " "))
        parser = _sglang_parser()
        ns, ignored = parser.parse_known_args(words)
    except (ValueError, argparse.ArgumentError) as err:
        # SGLang's own parser rejects these too, e.g. --hicache-size 300GB (it takes an int).
        raise TierserveError(f"cannot read SGLang flags: {err}", field="check_sglang") from err
    refuse_misspelt(parser, ignored, "SGLang", "check_sglang")
    parsed = SGLangFlags(**vars(ns))
    if min(parsed.tp, parsed.pp, parsed.dp, parsed.nnodes, parsed.page_size) <= 0:
        message = "SGLang --tp-size, --pp-size, --dp-size, --nnodes, --page-size must be > 0"
        raise TierserveError(message, field="check_sglang")
    ratio = parsed.hicache_ratio if parsed.hicache_ratio is not None else DEFAULT_RATIO
    if parsed.hicache_size_gb < 0 or not 0 <= ratio < 1e6:
        message = "SGLang --hicache-size must be >= 0 and --hicache-ratio in [0, 1e6)"
        raise TierserveError(message, field="check_sglang")
    host_fraction = parsed.hicache_host_memory_fraction
    if host_fraction is not None:
        name = "hicache-host-memory-fraction"
        check_mem_fraction(host_fraction, "check_sglang", "SGLang --", name, one_allowed=True)
    fraction = parsed.mem_fraction_static
    if fraction is not None:
        check_mem_fraction(fraction, field="check_sglang", who="SGLang --")
    return parsed


def sglang_kv_dtype(kv_cache_dtype: str | None, default: str) -> str:
    if kv_cache_dtype is None:
        return default
    try:
        return short_kv_dtype(kv_cache_dtype) or default
    except TierserveError:
        raise TierserveError(
            f"SGLang --kv-cache-dtype {kv_cache_dtype!r} is not one SGLang takes", "check_sglang"
        ) from None


def sglang_host_tokens(bytes_per_token: int, device_tokens: int, flags: SGLangFlags) -> int:
    """SGLang's host pool size in tokens: `--hicache-size` wins over the ratio, then the size is
    rounded up to whole pages plus one."""
    if flags.hicache_size_gb > 0:
        tokens = flags.hicache_size_gb * GB // bytes_per_token
    else:
        tokens = int(device_tokens * _ratio(flags))
    return (tokens // flags.page_size + SGLANG_EXTRA_PAGES) * flags.page_size


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
    version: SGLangVersion  # the release whose own behaviour `lines` describe

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "sglang_check",
            "sglang_version": str(self.version),
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


def _ratio(flags: SGLangFlags) -> float:
    return flags.hicache_ratio if flags.hicache_ratio is not None else DEFAULT_RATIO


def _sglang_inputs(flags: SGLangFlags, inputs: PlanInputs) -> PlanInputs:
    """The plan inputs with what the SGLang command line says instead of the plan's own flags."""
    device = inputs.device_tokens_per_rank
    if flags.max_total_tokens is not None:
        device = min(device or flags.max_total_tokens, flags.max_total_tokens)
    return dataclasses.replace(
        inputs,
        machine=dataclasses.replace(inputs.machine, gpus_per_node=flags.local_ranks),
        tp=flags.tp,
        pp=flags.pp,
        dp=flags.dp,
        dp_attention=flags.dp_attention and flags.dp > 1,  # groups made of the TP group's GPUs
        kv_dtype=sglang_kv_dtype(flags.kv_cache_dtype, inputs.kv_dtype),
        mem_fraction_static=flags.mem_fraction_static or inputs.mem_fraction_static,
        page_size=flags.page_size,
        host=HostRequest.auto(),
        device_tokens_per_rank=device,
        draft=draft_size(
            flags.speculative_algorithm,
            flags.speculative_draft_model_path,
            flags.speculative_num_steps,
            inputs.model,
            "check_sglang",
        ),
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
    ratio = _ratio(flags)
    return (
        f"--hicache-ratio {ratio:g} (no --hicache-size): device pool "
        f"{format_count(plan.device_tokens_per_rank)} tokens × {ratio:g} → {rounded}"
        f" × {bpt} = {per_rank} per rank"
    )


def _sglang_suggestion(plan: Plan, page_size: int) -> str:
    """Flags that fit; never `--hicache-size 0`, which SGLang reads as "use the ratio"."""
    budget, bpt = plan.budget, plan.kv.per_rank
    size_gb = sglang_size_gb(budget.max_bytes_per_rank, bpt, page_size)
    if size_gb == 0:
        return (
            f"no host cache of 1 GB per rank fits ({format_gb(budget.usable)} usable / "
            f"{budget.local_ranks} ranks): drop --enable-hierarchical-cache"
        )
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


def _process_line(flags: SGLangFlags) -> str:
    layout = f"{flags.tp} TP ranks"
    if flags.pp > 1:
        layout += f" × {flags.pp} pipeline stages"
    if flags.dp > 1 and not flags.dp_attention:
        layout += f" × {flags.dp} data-parallel groups"
    return f"SGLang starts {layout}: {flags.local_ranks} processes on this node, each its own pools"


def check_sglang(flags: str, inputs: PlanInputs, version: str = NEWEST) -> SGLangCheck:
    """Does this SGLang command line fit the machine in `inputs`, and what would SGLang
    `version` itself do? With SGLang's semantics: `--hicache-size` is decimal GB per rank, else
    host tokens = device tokens × `--hicache-ratio` (or, since v0.5.21 with neither given, the
    ratio SGLang fits to the node). `inputs` supplies the model, machine and anything the
    command line leaves out. The device is checked first: without a KV pool nothing else
    matters, and host RAM is not the cause."""
    release = SGLangVersion.parse(version)
    parsed = parse_sglang_flags(flags)
    plan = make_plan(_sglang_inputs(parsed, inputs))
    lines = [_process_line(parsed), _holds_line(plan), *draft_lines(plan)]
    blocking = [c for c in judge(plan).failed if c.name in ("device memory", "host RAM")]
    if blocking:  # no KV pool, or the processes alone exceed the node's RAM
        lines += [f"{c.name} does NOT fit: {c.arithmetic}; {c.fix}" for c in blocking]
        return SGLangCheck(parsed, plan, 0, 0, 0, False, blocking[0].fix, tuple(lines), release)
    if not parsed.hierarchical:
        lines.append("--enable-hierarchical-cache is not set: no host cache, sizes are ignored")
        return SGLangCheck(parsed, plan, 0, 0, 0, True, "", tuple(lines), release)
    if release.auto_sizes and parsed.hicache_size_gb == 0 and parsed.hicache_ratio is None:
        parsed, line = _auto_sized(parsed, plan, release)
        lines.append(line)
    tokens = sglang_host_tokens(plan.kv.per_rank, plan.device_tokens_per_rank, parsed)
    per_rank = tokens * plan.kv.per_rank
    fits = per_rank * plan.local_ranks <= plan.budget.usable
    lines.append(_sglang_request_line(parsed, plan, tokens))
    lines += _sglang_verdict_lines(plan, per_rank, fits)
    suggestion = "" if fits else _sglang_suggestion(plan, parsed.page_size)
    available = plan.budget.available
    lines.append(own_check_line(release, per_rank, available, plan.local_ranks))
    if suggestion:
        lines.append(f"what fits: {suggestion}")
    node = per_rank * plan.local_ranks
    return SGLangCheck(
        parsed, plan, tokens, per_rank, node, fits, suggestion, tuple(lines), release
    )


def _auto_sized(flags: SGLangFlags, plan: Plan, release: SGLangVersion) -> tuple[SGLangFlags, str]:
    """SGLang v0.5.21+ with neither a size nor a ratio: the flags with the ratio it fits."""
    fraction = flags.hicache_host_memory_fraction or DEFAULT_FRACTION
    device = plan.device_tokens_per_rank * plan.kv.per_rank
    ratio = auto_ratio(device, plan.budget.available, plan.local_ranks, fraction)
    line = (
        f"SGLang {release} sizes the host pools itself (no --hicache-size, no --hicache-ratio): "
        f"--hicache-host-memory-fraction {fraction:g} of (available − 10 GiB) // "
        f"{plan.local_ranks} ranks → ratio {ratio:.2f} (at most {DEFAULT_RATIO:g})"
    )
    return dataclasses.replace(flags, hicache_ratio=ratio), line


def _holds_line(plan: Plan) -> str:
    """What each rank holds and how many requests run at once, in this layout."""
    inputs, length = plan.inputs, format_count(plan.inputs.workload.avg_seq_len)
    tokens = format_count(plan.device_tokens_per_rank)
    if inputs.dp_attention:
        held = f"its attention group's own requests ({inputs.dp} groups of {inputs.attention_tp})"
    elif plan.spec.kind == "latent" and inputs.tp > 1:
        held = f"the same latents as the other {inputs.tp - 1} ranks"
    else:
        held = "its share of every running request's KV"
    return (
        f"each rank's device pool: {tokens} tokens of {held}; "
        f"{format_count(plan.device_concurrency)} requests of {length} tokens run at once"
    )


# --- the launch line -------------------------------------------------------------------------


def sglang_size_gb(max_bytes_per_rank: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Largest whole `--hicache-size` (decimal GB per rank) within `max_bytes_per_rank`, counting
    the page SGLang adds when it rounds the pool up."""
    return max(0, (max_bytes_per_rank - SGLANG_EXTRA_PAGES * page_size * bytes_per_token) // GB)


def _host_flags(plan: Plan, host: HostSizing) -> str:
    """A ratio stays a ratio; any size becomes whole decimal GB per rank, as SGLang wants it."""
    if host.mode == "ratio":
        return f" --enable-hierarchical-cache --hicache-ratio {plan.inputs.host.ratio:g}"
    largest = sglang_size_gb(host.max_bytes_per_rank, plan.kv.per_rank, plan.inputs.page_size)
    size_gb = min(round(host.bytes_per_rank / GB), largest)
    return f" --enable-hierarchical-cache --hicache-size {size_gb}" if size_gb > 0 else ""


def sglang_flags(plan: Plan, host: HostSizing | None, frac: str) -> str:
    inputs = plan.inputs
    flags = f"--tp-size {inputs.tp}" + (f" --pp-size {inputs.pp}" if inputs.pp > 1 else "")
    flags += f" --dp-size {inputs.dp}" if inputs.dp > 1 else ""
    flags += f" --mem-fraction-static {frac}"
    if inputs.device_tokens_per_rank is not None:
        flags += f" --max-total-tokens {inputs.device_tokens_per_rank}"
    if inputs.page_size != 1:  # SGLang's default page is 1 token, as the plan's
        flags += f" --page-size {inputs.page_size}"
    flags += kv_dtype_flag(plan, "fp8_e4m3")
    return flags + (_host_flags(plan, host) if host is not None else "")
