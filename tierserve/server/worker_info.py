"""What a router, a probe or an operator asks a worker about itself, answered in SGLang's and
vLLM's shapes: `/health`, `/health_generate`, `/metrics`, `/v1/models`, `/version`,
`/flush_cache`; sglang-router reads `/server_info` (or `/get_server_info`) and `/model_info`
(or `/get_model_info`) when a worker joins, for the model and tokenizer paths and the parallel
layout, and `/get_load` for its power_of_two policy (the sum of `num_tokens`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from tierserve.args import EngineArgs
from tierserve.core_messages import CoreInfo, MetricFamily
from tierserve.sampling_params import SamplingParams
from tierserve.server.async_engine import EngineDeadError
from tierserve.server.context import ServerContext
from tierserve.server.protocol import now

# On /get_load, when the core did not answer in time: the seconds since its values were read.
STALE_HEADER = "x-tierserve-stale-seconds"

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
        return package_version("tierserve")
    except PackageNotFoundError:
        return "unknown"


def register(app: FastAPI, ctx: ServerContext) -> None:
    engine, model = ctx.engine, ctx.model

    @app.get("/health")
    async def health() -> dict[str, str]:
        if engine.error is not None:
            raise EngineDeadError(str(engine.error))
        return {"status": "ok"}

    probe: asyncio.Future | None = None

    async def generate_one_token() -> None:
        # Never a hidden-states file: probes are open without the key on a capturing server.
        params = SamplingParams(max_tokens=1, temperature=0, return_hidden_states=False)
        async for _ in engine.generate([0], params, f"health-generate-{uuid.uuid4().hex}"):
            pass

    @app.get("/health_generate")
    async def health_generate() -> dict[str, str]:
        """SGLang's: healthy only when the engine generates a token (a core that is up but
        stuck fails here, and past --watchdog-timeout everywhere). One probe runs at a time:
        callers that come while it runs share its verdict."""
        nonlocal probe
        if engine.error is not None:
            raise EngineDeadError(str(engine.error))
        if probe is None or probe.done():
            probe = asyncio.ensure_future(generate_one_token())
        await asyncio.shield(probe)  # a caller that leaves does not end the others' probe
        return {"status": "ok"}

    @app.get("/get_load")
    @app.get("/get_loads")
    async def get_load() -> JSONResponse:
        """Within STATE_WAIT_S: the last known load when the core does not answer in time (a
        503 here makes sglang-router drop the worker), marked by a header with its age (the
        body keeps SGLang's shape, which the router parses)."""
        families, age = await engine.recent_metrics()
        stale = {} if age == 0 else {STALE_HEADER: "unknown" if age is None else f"{age:.3f}"}
        return JSONResponse(loads(families, engine.info.page_size), headers=stale)

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name; sglang-router tries both
    async def get_server_info() -> dict[str, Any]:
        return server_info(engine.args or EngineArgs(), engine.info, model)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(engine.info)

    def card() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": now(), "owned_by": "tierserve",
                "max_model_len": engine.info.context_length}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve
    async def one_model(name: str) -> dict[str, Any]:
        ctx.check_model(name)
        return card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version("tierserve")}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = ctx.metrics.render(*await engine.recent_metrics())
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        tiers = await engine.flush_cache()
        return {"flushed_pages": tiers["device_pages"], "tiers": tiers}
