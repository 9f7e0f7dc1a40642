"""`tierserve plan --check-vllm`: what a vLLM command line asks of a machine.

vLLM's semantics (V1, native KV offloading): every TP rank of every pipeline stage is a worker
process, and each data-parallel replica is a whole engine of them; `--kv-offloading-size` is GiB
for one engine, split across its tp × pp workers, so the node holds dp × that much;
`--gpu-memory-utilization` covers weights, KV and activations (the static-fraction formula used
here is an upper bound on vLLM's pool); and vLLM refuses to start when one request of
`--max-model-len` (default: the model's max_position_embeddings) does not fit in the KV pool.
The check is the plan's own verdict under those flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from dataclasses import dataclass
from typing import Any

from tierserve.errors import TierserveError
from tierserve.plan.draft import draft_size
from tierserve.plan.misspelt import refuse_misspelt
from tierserve.plan.plan import Plan, PlanInputs, draft_lines, kv_dtype_flag, make_plan
from tierserve.plan.verdict import Constraint, Verdict, judge
from tierserve.sizing import DraftSize, HostRequest, HostSizing, short_kv_dtype
from tierserve.utils import GiB, format_count

VLLM_DEFAULT_UTILIZATION = 0.9
VLLM_DEFAULT_BLOCK = 16


@dataclass(frozen=True)
class VLLMFlags:
    """The part of a vLLM command line that decides memory, with vLLM's defaults."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpu_memory_utilization: float = VLLM_DEFAULT_UTILIZATION
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = VLLM_DEFAULT_BLOCK
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float = 0.0  # GiB for one engine (all its TP × PP workers)
    model: str | None = None
    speculative_config: str | None = None  # JSON: method, model, num_speculative_tokens

    @property
    def local_ranks(self) -> int:
        return self.tp * self.pp * self.dp


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--tensor-parallel-size", "-tp", dest="tp", type=int, default=1)
    add("--pipeline-parallel-size", "-pp", dest="pp", type=int, default=1)
    add("--data-parallel-size", "-dp", dest="dp", type=int, default=1)
    add("--gpu-memory-utilization", type=float, default=VLLM_DEFAULT_UTILIZATION)
    add("--kv-cache-dtype", default="auto")
    add("--max-model-len", type=int, default=None)
    add("--block-size", type=int, default=VLLM_DEFAULT_BLOCK)
    add("--num-gpu-blocks-override", type=int, default=None)
    add("--kv-offloading-size", type=float, default=0.0)
    add("--model", dest="model", default=None)
    add("--speculative-config", default=None)
    return parser


def parse_vllm_flags(flags: str) -> VLLMFlags:
    """Read a vLLM command line (`vllm serve MODEL …` is fine); other flags are ignored."""
    try:
        words = shlex.split(flags.replace("\\\n", " "))
        parser = _parser()
        ns, rest = parser.parse_known_args(words)
    except (ValueError, argparse.ArgumentError) as err:
        raise TierserveError(f"cannot read vLLM flags: {err}", field="check_vllm") from err
    refuse_misspelt(parser, rest, "vLLM", "check_vllm")
    if ns.model is None and len(rest) >= 2 and rest[:2] == ["vllm", "serve"] and len(rest) > 2:
        ns.model = rest[2]
    parsed = VLLMFlags(**vars(ns))
    if min(parsed.tp, parsed.pp, parsed.dp, parsed.block_size) <= 0:
        message = "vLLM -tp, -pp, -dp and --block-size must be > 0"
        raise TierserveError(message, field="check_vllm")
    if not 0 < parsed.gpu_memory_utilization <= 1:
        message = (
            f"vLLM --gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}"
        )
        raise TierserveError(message, field="check_vllm")
    if not 0 <= parsed.kv_offloading_size < 1e6:
        message = f"vLLM --kv-offloading-size must be in [0, 1e6) GiB, got {ns.kv_offloading_size}"
        raise TierserveError(message, field="check_vllm")
    try:
        short_kv_dtype(parsed.kv_cache_dtype)
    except TierserveError:
        message = f"vLLM --kv-cache-dtype {parsed.kv_cache_dtype!r} is not one vLLM takes"
        raise TierserveError(message, field="check_vllm") from None
    return parsed


@dataclass(frozen=True)
class VLLMCheck:
    flags: VLLMFlags
    verdict: Verdict  # of the plan under the command line's layout, utilization, dtype, block
    constraints: tuple[Constraint, ...]  # the plan's, in vLLM's words and units
    lines: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    @property
    def plan(self) -> Plan:
        return self.verdict.plan

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "kind": "vllm_check",
            "vllm_flags": dataclasses.asdict(self.flags),
            "local_ranks": plan.local_ranks,
            "kv_bytes_per_token_per_rank": plan.kv.per_rank,
            "device_tokens_per_rank": plan.device_tokens_per_rank,
            "host_bytes_per_rank": plan.host.bytes_per_rank,
            "host_bytes_per_node": plan.host.bytes_per_node,
            "host_usable_bytes": plan.budget.usable,
            "fits": self.fits,
            "constraints": [dataclasses.asdict(c) for c in self.constraints],
            "explanation": list(self.lines),
        }


def _vllm_inputs(flags: VLLMFlags, inputs: PlanInputs) -> PlanInputs:
    kv_dtype = short_kv_dtype(flags.kv_cache_dtype) or inputs.kv_dtype
    device = inputs.device_tokens_per_rank
    if flags.num_gpu_blocks_override is not None:
        device = flags.num_gpu_blocks_override * flags.block_size
    max_len = flags.max_model_len or inputs.model.config.max_position_embeddings
    # One engine's offload buffer per data-parallel replica, all on this node.
    per_node = int(flags.kv_offloading_size * GiB) * flags.dp
    host = HostRequest.per_node(per_node) if per_node else HostRequest("off")
    # For a MoE model vLLM's data parallelism is attention data parallelism: each engine's
    # attention and KV are its own, the experts span all tp × dp workers.
    groups = _dp_attention(flags, inputs)
    return dataclasses.replace(
        inputs,
        machine=dataclasses.replace(inputs.machine, gpus_per_node=flags.local_ranks),
        tp=flags.tp * flags.dp if groups else flags.tp,
        pp=flags.pp,
        dp=flags.dp,
        dp_attention=groups,
        dense_per_group=groups,
        kv_dtype=kv_dtype,
        mem_fraction_static=min(flags.gpu_memory_utilization, 0.999),
        page_size=flags.block_size,
        host=host,
        device_tokens_per_rank=device,
        context_length=max_len or None,
        draft=_vllm_draft(flags, inputs),
    )


# vLLM's speculative methods as SGLang's algorithm names (draft_size reads those).
_VLLM_METHODS = {
    "ngram": "NGRAM",
    "eagle": "EAGLE3",
    "eagle3": "EAGLE3",
    "deepseek_mtp": "NEXTN",
    "mtp": "NEXTN",
}


def _vllm_draft(flags: VLLMFlags, inputs: PlanInputs) -> DraftSize | None:
    if flags.speculative_config is None:
        return None
    try:
        raw = json.loads(flags.speculative_config)
    except ValueError as err:
        message = f"vLLM --speculative-config is not JSON: {err}"
        raise TierserveError(message, "check_vllm") from None
    method = raw.get("method") if isinstance(raw, dict) else None
    if method not in _VLLM_METHODS:
        known = ", ".join(_VLLM_METHODS)
        message = f"vLLM --speculative-config method {method!r}: the plan knows {known}"
        raise TierserveError(message, "check_vllm")
    steps = raw.get("num_speculative_tokens")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    model = raw.get("model") if isinstance(raw.get("model"), str) else None
    return draft_size(_VLLM_METHODS[method], model, steps, inputs.model, "check_vllm")


def _dp_attention(flags: VLLMFlags, inputs: PlanInputs) -> bool:
    return flags.dp > 1 and inputs.model.config.moe is not None


def check_vllm(flags: str, inputs: PlanInputs) -> VLLMCheck:
    """Does this vLLM command line fit the machine in `inputs`? `inputs` supplies the model,
    the machine and anything the command line leaves out."""
    parsed = parse_vllm_flags(flags)
    plan = make_plan(_vllm_inputs(parsed, inputs))
    verdict = judge(plan)
    layout = f"{parsed.tp} TP × {parsed.pp} PP workers"
    layout += f" × {parsed.dp} data-parallel engines" if parsed.dp > 1 else ""
    lines = [f"vLLM starts {layout}: {parsed.local_ranks} processes on this node"]
    lines += draft_lines(verdict.plan)
    if _dp_attention(parsed, inputs):
        lines.append(
            f"a MoE model: each engine's attention and KV are its own requests' (DP attention), "
            f"its dense MLPs and shared experts its own, the routed experts split over all "
            f"{parsed.tp * parsed.dp} workers; "
            f"{format_count(plan.device_concurrency)} requests of "
            f"{format_count(inputs.workload.avg_seq_len)} tokens run at once"
        )
    said = []
    for c in verdict.constraints:
        if c.name == "context length":  # vLLM's word for it, and its reaction
            c = dataclasses.replace(
                c,
                name="max-model-len",
                arithmetic=c.arithmetic.replace("--context-length", "--max-model-len")
                + ("" if c.holds else "; vLLM refuses to start"),
                fix=c.fix.replace("--context-length", "--max-model-len"),
                suggest={"max_model_len": c.suggest["context_length"]} if c.suggest else {},
            )
        if c.name == "host RAM" and not c.holds and plan.budget.usable > 0:
            # vLLM's unit: GiB for one engine (its tp × pp workers), one buffer per dp engine.
            workers = parsed.tp * parsed.pp
            gib = plan.recommended.bytes_per_rank * workers // GiB
            fix = f"--kv-offloading-size {gib} at most" if gib else "no offloading buffer fits"
            c = dataclasses.replace(c, fix=fix, suggest={"kv_offloading_size": gib} if gib else {})
        said.append(c)
        lines.append(f"{'ok' if c.holds else 'does NOT fit'}: {c.name}: {c.arithmetic}")
        if c.fix:
            lines.append(f"  instead: {c.fix}")
    return VLLMCheck(parsed, verdict, tuple(said), tuple(lines))


# --- the launch line -------------------------------------------------------------------------


def vllm_flags(plan: Plan, host: HostSizing | None, frac: str) -> str:
    inputs = plan.inputs
    flags = f"--tensor-parallel-size {inputs.tp} --gpu-memory-utilization {frac}"
    flags += f" --pipeline-parallel-size {inputs.pp}" if inputs.pp > 1 else ""
    flags += f" --data-parallel-size {inputs.dp}" if inputs.dp > 1 else ""
    flags += f" --block-size {inputs.page_size}" if inputs.page_size != 1 else ""
    # vLLM refuses to start unless one request of max_model_len (default: the model's
    # max_position_embeddings) fits in the pool: cap it at what the plan's pool holds.
    block = inputs.page_size if inputs.page_size != 1 else VLLM_DEFAULT_BLOCK
    cfg_max = inputs.model.config.max_position_embeddings
    max_len = min(inputs.context_length or cfg_max, plan.device_tokens_per_rank // block * block)
    if max_len < cfg_max or inputs.context_length:
        flags += f" --max-model-len {max_len}"
    if inputs.device_tokens_per_rank is not None:  # vLLM's --max-total-tokens, in blocks
        flags += f" --num-gpu-blocks-override {inputs.device_tokens_per_rank // block}"
    flags += kv_dtype_flag(plan, "fp8")
    # vLLM's --kv-offloading-size is GiB for the whole instance, split across its workers.
    gib = host.bytes_per_rank * inputs.tp * inputs.pp // GiB if host is not None else 0
    if gib > 0:
        flags += f" --kv-offloading-backend native --kv-offloading-size {gib}"
    return flags
