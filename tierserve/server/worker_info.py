"""What a router asks a worker about itself, answered in SGLang's shapes: sglang-router reads
`/server_info` (or `/get_server_info`) and `/model_info` (or `/get_model_info`) when a worker
joins, for the model and tokenizer paths and the parallel layout, and `/get_load` for its
power_of_two policy (the sum of `num_tokens`)."""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tierserve.args import EngineArgs
from tierserve.messages import CoreInfo, MetricFamily

REDACTED = "<redacted>"
# Flags whose values may hold a store's or a peer's address, credentials, or where this node
# keeps its data: /server_info names them, never says them.
SECRET_FLAGS = ("dist_init_addr", "hidden_states_dir")


def server_info(args: EngineArgs, info: CoreInfo, served_name: str) -> dict[str, Any]:
    """SGLang's /get_server_info: the server's arguments (tierserve's flags, and SGLang's
    names for the ones a router reads) and the engine's sizes; addresses, paths of data and
    the storage backend's extra config are redacted."""
    flags = dataclasses.asdict(args)
    for name in SECRET_FLAGS:
        if flags[name] is not None:
            flags[name] = REDACTED
    flags["hicache_storage_backend_extra_config"] = _redacted_extra(
        args.hicache_storage_backend_extra_config
    )
    return {
        **flags,
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "served_model_name": served_name,
        "dp_size": args.dp_groups,
        "max_total_num_tokens": info.num_pages * info.page_size,
        "context_length": info.context_length,
        "version": _version(),
    }


def model_info(info: CoreInfo) -> dict[str, Any]:
    """SGLang's /get_model_info."""
    config = _config(info.model_path)
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def loads(families: list[MetricFamily], page_size: int) -> list[dict[str, int]]:
    """SGLang's /get_load: per attention group (one without DP attention), the requests
    running and waiting and the device KV tokens in use, read from the engine's metrics."""
    by_name = {f.name: f for f in families}
    if "tierserve_num_requests_running" not in by_name:  # the core has not answered yet
        return [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    def values(name: str) -> list[int]:
        return [int(v) for _, v in by_name[name].samples]

    if "tierserve_dp_requests_running" in by_name:
        running = values("tierserve_dp_requests_running")
        waiting = values("tierserve_dp_requests_waiting")
        tokens = values("tierserve_dp_device_tokens_used")
    else:
        running = values("tierserve_num_requests_running")
        waiting = values("tierserve_num_requests_waiting")
        pages = {labels[0]: v for labels, v in by_name["tierserve_kv_pages_used"].samples}
        tokens = [int(pages.get("device", 0)) * page_size]
    return [
        {"dp_rank": g, "num_reqs": r, "num_waiting_reqs": w, "num_tokens": t}
        for g, (r, w, t) in enumerate(zip(running, waiting, tokens, strict=True))
    ]


def _redacted_extra(text: str | None) -> dict[str, str] | str | None:
    """The extra config's keys (what a user set), none of its values."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError:
        return REDACTED
    return {str(key): REDACTED for key in config} if isinstance(config, dict) else REDACTED


def _config(model_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _version() -> str:
    try:
        return version("tierserve")
    except PackageNotFoundError:
        return "unknown"
