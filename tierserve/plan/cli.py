"""`tierserve plan`: KV capacity and host-cache sizing before launch, for tierserve, SGLang, vLLM.

This module reads flags, files and this machine's free RAM; all arithmetic is in plan/plan.py.
One thing at some length: the command's flags, read into one PlanInputs (or a check's).
Exit status: 0 the plan fits, 1 it does not (the output says why and what does), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tierserve.args import EngineArgs, check_host_ratio, ranks_per_node
from tierserve.errors import TierserveError
from tierserve.model_config import read_hf_config
from tierserve.plan.draft import draft_size
from tierserve.plan.plan import DEFAULT_AVG_SEQ_LEN, Machine, PlanInputs, Workload, make_plan
from tierserve.plan.presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    ModelPreset,
    find_model_preset,
    gpu_preset,
)
from tierserve.plan.render import plan_json, render_check, render_plan
from tierserve.plan.sglang import check_sglang, parse_sglang_flags
from tierserve.plan.sglang_versions import NEWEST
from tierserve.plan.verdict import judge
from tierserve.plan.vllm import check_vllm, parse_vllm_flags
from tierserve.plan.weights import WEIGHT_DTYPE_BYTES, ModelSpec, model_spec
from tierserve.sizing import DEFAULT_MARGIN, HostRequest, host_request, short_kv_dtype
from tierserve.storage import StorageConfig, backend_class
from tierserve.utils import JSON_SCHEMA_VERSION, GiB, emit, format_gb, parse_size

SIZES = "sizes: 48GB, 48GiB, 0.5TB, 300MB; a bare number is decimal GB (as SGLang's flags)"
EPILOG = f"""{SIZES}. Exit status: 0 the plan fits, 1 it does not, 2 bad input.
Per rank = one TP process (one GPU); per node = all ranks on one machine, sharing its RAM."""


# Flags `plan` shares with `serve`, from the one definition (EngineArgs), with the plan's own
# defaults: SGLang's page size of 1, and no length or concurrency to check unless asked. The
# plan's --model, --tp, --nnodes, --kv-cache-dtype and host-cache flags are its own on purpose:
# they describe any engine's deployment (a preset or a hub id, tp × pp × dp ranks, SGLang's and
# vLLM's dtype spellings, no host cache unless asked or the largest that fits), not this
# server's; the host flags are read by the same function as serve's (sizing.pools.host_request).
SHARED_FLAGS = (
    "mem_fraction_static",
    "max_total_tokens",
    "page_size",
    "context_length",
    "max_running_requests",
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
)
PLAN_DEFAULTS = {"page_size": 1, "max_running_requests": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    EngineArgs.add_cli_args(parser, only=SHARED_FLAGS, defaults=PLAN_DEFAULTS)
    parser.add_argument(
        "--concurrency",
        type=int,
        dest="max_running_requests",
        metavar="N",
        help="the same as --max-running-requests: requests that must run at once",
    )
    _add_model_arguments(parser)
    _add_machine_arguments(parser)
    _add_host_request(parser)
    add = parser.add_argument
    add(
        "--avg-seq-len",
        type=int,
        default=DEFAULT_AVG_SEQ_LEN,
        metavar="N",
        help=f"prompt + output tokens of an average request ({DEFAULT_AVG_SEQ_LEN})",
    )
    add(
        "--check-sglang",
        metavar="FLAGS",
        help="check an SGLang command line instead, e.g. "
        '"--tp-size 8 --enable-hierarchical-cache --hicache-size 48"',
    )
    add(
        "--sglang-version",
        default=NEWEST,
        metavar="V",
        help=(
            "the SGLang release --check-sglang describes (what it does with pools that do not "
            f"fit: hang before 0.5.19, refuse since, auto-size since 0.5.21); default {NEWEST}"
        ),
    )
    add(
        "--check-vllm",
        metavar="FLAGS",
        help="check a vLLM command line instead, e.g. "
        '"--tensor-parallel-size 8 --kv-offloading-backend native --kv-offloading-size 300"',
    )
    add("--json", action="store_true", help="print JSON instead of a table")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--model",
        metavar="PATH_OR_PRESET",
        help=f"checkpoint directory, its config.json, or a preset: {', '.join(MODEL_PRESETS)}",
    )
    add(
        "--kv-dtype",
        "--kv-cache-dtype",
        default="bf16",
        type=_kv_dtype,
        help="KV cache dtype: bf16, fp16, fp32, fp8 (SGLang's and vLLM's spellings too: "
        "auto, bfloat16, fp8_e4m3, fp8_e5m2)",
    )
    add(
        "--kv-bytes-per-token",
        type=int,
        metavar="N",
        help="measured KV bytes per token PER RANK (as the server logs it); overrides the formula",
    )
    add(
        "--weights",
        metavar="SIZE",
        help="weights of all ranks together (the checkpoint's size); default: the "
        "directory's *.safetensors, else parameters × dtype",
    )
    add(
        "--weight-dtype",
        choices=sorted(WEIGHT_DTYPE_BYTES),
        help="estimate weights as parameters × this dtype (default: the checkpoint's)",
    )


def _add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--tp",
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks, one per GPU (1)",
    )
    add(
        "--pp",
        "--pp-size",
        "--pipeline-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="pipeline stages; each holds layers/pp and is tp more processes (1)",
    )
    add(
        "--dp",
        "--dp-size",
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help=(
            "data-parallel replicas, each tp × pp more processes with their own pools (1); "
            "with --enable-dp-attention, attention groups inside the tp ranks"
        ),
    )
    add(
        "--enable-dp-attention",
        action="store_true",
        help=(
            "--dp attention groups of tp/dp ranks (SGLang's flag): each holds only its own "
            "requests' KV, so an MLA latent is no longer the same on every rank"
        ),
    )
    add(
        "--gpu",
        default="h100-80gb",
        metavar="PRESET_OR_SIZE",
        help=f"memory of one GPU: {', '.join(GPU_PRESETS)}, or a size (h100-80gb)",
    )
    add("--gpus", type=int, metavar="N", help="GPUs per node (default: tp × pp × dp / --nnodes)")
    add("--nnodes", type=int, default=1, metavar="N", help="nodes the tp × pp × dp ranks span (1)")
    add(
        "--host-mem",
        metavar="SIZE",
        help="host RAM available on one node (default: read from this machine)",
    )
    add(
        "--overhead",
        metavar="SIZE",
        help="host RAM the server takes besides its KV cache, per node "
        "(default: 5GB per local rank)",
    )
    add(
        "--margin",
        default=f"{DEFAULT_MARGIN // GiB}GiB",
        metavar="SIZE",
        help=f"host RAM kept free, per node ({DEFAULT_MARGIN // GiB}GiB)",
    )


def _add_host_request(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    add = group.add_argument
    add(
        "--host-per-node",
        "--hicache-node-size",
        metavar="SIZE",
        help="host cache of the whole node, all ranks together (serve's --hicache-node-size)",
    )
    add(
        "--host-per-rank",
        "--hicache-size",
        metavar="SIZE",
        help="host cache of each rank (what SGLang's and serve's --hicache-size mean)",
    )
    add(
        "--host-ratio",
        "--hicache-ratio",
        type=float,
        metavar="R",
        help="host tokens = device tokens × R (SGLang's --hicache-ratio)",
    )
    add("--no-host-cache", action="store_true", help="device pool only")
    # None of the four: the largest host cache that fits.


def run(ns: argparse.Namespace) -> int:
    inputs = build_inputs(ns, load_model(_model_arg(ns), ns.weight_dtype, _weights(ns)))
    if ns.check_sglang is not None and ns.check_vllm is not None:
        raise TierserveError("give --check-sglang or --check-vllm, not both", "check_vllm")
    if ns.check_sglang is not None:
        check = check_sglang(ns.check_sglang, inputs, ns.sglang_version)
    elif ns.check_vllm is not None:
        check = check_vllm(ns.check_vllm, inputs)
    else:
        check = None
    if check is not None:
        emit(_json(check.to_dict()) if ns.json else render_check(check))
        return 0 if check.fits else 1
    plan = make_plan(inputs)
    verdict = judge(plan)
    emit(_json(plan_json(verdict)) if ns.json else render_plan(verdict))
    return 0 if verdict.fits else 1


def _json(data: dict) -> str:
    return json.dumps({"schema_version": JSON_SCHEMA_VERSION, **data}, indent=2)


# ---------------------------------------------------------------------------------------------
# Inputs


def _kv_dtype(text: str) -> str:
    """The planner's short KV dtype names, from ours, SGLang's or vLLM's spelling."""
    try:
        name = short_kv_dtype(text)
    except TierserveError as err:
        raise argparse.ArgumentTypeError(f"{err.message}, auto") from None
    return name or "bf16"  # auto: the model's dtype, bf16 for the checkpoints planned here


def _model_arg(ns: argparse.Namespace) -> str:
    """--model, else the --model-path of the SGLang command line being checked."""
    if ns.model:
        return ns.model
    if ns.check_sglang is not None:
        path = parse_sglang_flags(ns.check_sglang).model_path
        if path:
            return path
    if ns.check_vllm is not None:
        path = parse_vllm_flags(ns.check_vllm).model
        if path:
            return path
    raise TierserveError("give --model: a preset, a checkpoint directory or a config.json", "model")


def _weights(ns: argparse.Namespace) -> int | None:
    return _optional_size(ns.weights, "weights")


def _optional_size(text: str | None, field: str) -> int | None:
    return None if text is None else parse_size(text, field=field)


def load_model(text: str, weight_dtype: str | None, weights: int | None) -> ModelSpec:
    """A preset name, a checkpoint directory, or a config.json path."""
    path = Path(text).expanduser()
    if not path.exists():
        preset = _preset_for(text)
        spec = model_spec(
            preset.name,
            preset.config,
            preset.num_parameters,
            weight_dtype,
            weights,
        )
        return _with_path(spec, preset.hf_id)
    config_path = path / "config.json" if path.is_dir() else path
    config = read_hf_config(path)
    if weights is None and weight_dtype is None:
        weights = _safetensors_bytes(config_path.parent)
    name = config_path.parent.name or str(config_path.parent)
    spec = model_spec(name, config, weight_dtype=weight_dtype, weights=weights)
    return _with_path(spec, str(config_path.parent))


def _preset_for(text: str) -> ModelPreset:
    """A name that is not on disk: a preset, by name or Hugging Face id, or a clear error."""
    preset = find_model_preset(text)
    if preset is not None:
        return preset
    known = ", ".join(MODEL_PRESETS)
    if text.startswith(("/", ".", "~")) or text.endswith(("/", ".json")):
        message = f"model directory not found: {text} (or give a preset: {known})"
    elif "/" in text:
        message = (
            f"{text} is not a local directory and no preset matches it; download it "
            f"(huggingface-cli download {text} --local-dir DIR) and give --model DIR, "
            f"or a preset: {known}"
        )
    else:
        message = f"unknown model preset {text!r} and no such directory; presets: {known}"
    raise TierserveError(message, field="model")


def _safetensors_bytes(directory: Path) -> int | None:
    """The checkpoint's own size is the best weight estimate there is."""
    sizes = [f.stat().st_size for f in directory.glob("*.safetensors")]
    return sum(sizes) or None


def _with_path(spec: ModelSpec, path: str) -> ModelSpec:
    return dataclasses.replace(spec, path=path)


def _gpu(text: str) -> tuple[str, int]:
    preset = gpu_preset(text)
    if preset is not None:
        return preset.name, preset.memory_bytes
    size = parse_size(text, field="gpu")
    return format_gb(size), size


def _gpus_per_node(ns: argparse.Namespace) -> int | None:
    """--gpus, else SGLang's --nnodes: the ranks split evenly over the nodes."""
    if ns.gpus is not None or ns.nnodes == 1:
        return ns.gpus
    replicas = 1 if ns.enable_dp_attention else ns.dp  # attention groups add no ranks
    return ranks_per_node(ns.tp * ns.pp * replicas, ns.nnodes, "tp × pp × dp =")


def _host_available(text: str | None) -> tuple[int, str]:
    if text is not None:
        return parse_size(text, field="host_mem"), "--host-mem"
    import psutil  # only when asked to read this machine

    return psutil.virtual_memory().available, "this machine, psutil"


def _host_request(ns: argparse.Namespace) -> HostRequest:
    if ns.host_ratio is not None:  # as serve refuses its --hicache-ratio
        check_host_ratio(ns.host_ratio, "host_ratio")
    return host_request(ns.host_per_node, ns.host_per_rank, ns.host_ratio, ns.no_host_cache)


def _storage_ram(ns: argparse.Namespace) -> int:
    """RAM each server process's storage client takes (Mooncake's segment and buffer)."""
    if ns.hicache_storage_backend is None:
        return 0
    extra = ns.hicache_storage_backend_extra_config
    cfg = StorageConfig.parse(ns.hicache_storage_backend, extra)
    return backend_class(cfg.backend).ram_bytes(cfg.extra)


def build_inputs(ns: argparse.Namespace, model: ModelSpec) -> PlanInputs:
    gpu_name, gpu_memory = _gpu(ns.gpu)
    available, source = _host_available(ns.host_mem)
    machine = Machine(
        gpu_name=gpu_name,
        gpu_memory=gpu_memory,
        host_available=available,
        host_source=source,
        gpus_per_node=_gpus_per_node(ns),
        host_overhead=_optional_size(ns.overhead, "overhead"),
        host_margin=parse_size(ns.margin, field="margin"),
        storage_ram_per_process=_storage_ram(ns),
    )
    return PlanInputs(
        model=model,
        machine=machine,
        tp=ns.tp,
        pp=ns.pp,
        dp=ns.dp,
        dp_attention=ns.enable_dp_attention,
        kv_dtype=ns.kv_dtype,
        mem_fraction_static=ns.mem_fraction_static,
        page_size=ns.page_size,
        host=_host_request(ns),
        workload=Workload(ns.avg_seq_len, ns.max_running_requests),
        kv_bytes_per_token_per_rank=ns.kv_bytes_per_token,
        device_tokens_per_rank=ns.max_total_tokens,
        context_length=ns.context_length,
        draft=draft_size(
            ns.speculative_algorithm,
            ns.speculative_draft_model_path,
            ns.speculative_num_steps,
            model,
            "speculative_algorithm",
        ),
    )
