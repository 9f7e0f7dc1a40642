"""The launch lines a plan prints: the same device pool and a host cache that fits, as each
engine's flags say it (tierserve's here; SGLang's and vLLM's in plan/sglang.py and plan/vllm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.plan.plan import Plan, kv_dtype_flag
from tierserve.plan.sglang import sglang_flags
from tierserve.plan.verdict import Verdict
from tierserve.plan.vllm import vllm_flags
from tierserve.sizing import HostSizing
from tierserve.utils import GB


@dataclass(frozen=True)
class LaunchFlags:
    tierserve: str
    sglang: str
    vllm: str


def fitting_host(plan: Plan) -> HostSizing | None:
    """The host cache the launch lines ask for: the requested one when it fits, else the
    largest that does; None when there is to be none (asked for none, or none fits)."""
    if plan.host.mode == "off":
        return None
    host = plan.host if plan.host.fits else plan.recommended
    return host if host.bytes_per_rank >= GB else None  # under 1 GB a rank: not worth a tier


def launch_flags(verdict: Verdict) -> LaunchFlags:
    """Flags that give each server the plan's device pool and a host cache that fits."""
    plan = verdict.plan
    host = fitting_host(plan)
    # Exact: the launch gets the plan's pool, not one token more or less.
    frac = repr(plan.inputs.mem_fraction_static)
    return LaunchFlags(
        _tierserve_flags(plan, host, frac),
        sglang_flags(plan, host, frac),
        vllm_flags(plan, host, frac),
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
    flags += f" --page-size {inputs.page_size}" + kv_dtype_flag(plan, "fp8_e4m3")
    if inputs.context_length is not None:
        flags += f" --context-length {inputs.context_length}"
    if host is not None:
        flags += f" --enable-hierarchical-cache --hicache-node-size {host.bytes_per_node // GB}GB"
    return flags
