"""One chat request traced through the API process: how often it moves between tierserve's
modules (issue 75's measure of how many rooms a reader walks through).

    .venv/bin/python scripts/trace_request.py [--label NAME] [--max-tokens 4]

The server is built as `tierserve serve` builds it (the engine core in its own process, the
`AsyncEngine`, `create_app`) on the bundled demo model, and one non-streamed
`/v1/chat/completions` request is sent in this thread through httpx's ASGI transport, with
`sys.setprofile` on for that request only. Whenever Python enters or returns into a frame, the
room is the module of the innermost tierserve frame; a transition is a change of room
(frames of FastAPI, Starlette or asyncio between two tierserve frames do not count). The
core's process is not traced: the request's walk through the API process is.

Prints the rooms in the order first entered with the stays in each, and the totals (every
move, and the distinct moves: the per-token loop repeats the same few); with
`--label`, adds them to scripts/trace_request.json under that label (before / after a
refactor).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "tierserve")
RESULTS = Path(__file__).with_suffix(".json")


def room(frame: FrameType | None) -> str | None:
    """The module of the innermost tierserve frame at or above `frame`."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            return str(Path(path).relative_to(ROOT).with_suffix("")).replace("/", ".")
        frame = frame.f_back
    return None


class Walk:
    """The rooms one traced stretch of execution passes through, in order."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.stays: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        # On a return the frame is still the one returning: its caller is where we land.
        now = room(frame if event == "call" else frame.f_back)
        if now is not None and now != self.current:
            self.stays.append(now)
            self.current = now


async def one_request(app: Any, walk: Walk, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://trace")
    async with app.router.lifespan_context(app), client:
        await client.post("/v1/chat/completions", json=body)  # warm: imports, caches
        sys.setprofile(walk)
        try:
            reply = await client.post("/v1/chat/completions", json=body)
        finally:
            sys.setprofile(None)
    reply.raise_for_status()
    return reply.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label")
    ap.add_argument("--max-tokens", type=int, default=4)
    ns = ap.parse_args()
    from tierserve.args import EngineArgs, default_model
    from tierserve.server.api import create_app
    from tierserve.server.async_engine import AsyncEngine

    args = EngineArgs(model=default_model(), max_total_tokens=4096)
    app = create_app(AsyncEngine.launch(args, "warning"), "demo")
    walk = Walk()
    reply = asyncio.run(one_request(app, walk, ns.max_tokens))
    assert reply["usage"]["completion_tokens"] >= 1, reply
    stays = Counter(walk.stays)
    edges = set(zip(walk.stays, walk.stays[1:], strict=False))
    totals = {
        "rooms": len(stays),
        "stays": len(walk.stays),
        "transitions": max(len(walk.stays) - 1, 0),
        # the distinct moves (from, to): the paths a reader follows, each once
        "distinct_transitions": len(edges),
        "max_tokens": ns.max_tokens,
        "by_room": dict(stays),
    }
    for name, count in stays.items():
        print(f"{count:5d}  {name}")
    print(json.dumps({k: v for k, v in totals.items() if k != "by_room"}))
    if ns.label:
        kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        kept[ns.label] = totals
        RESULTS.write_text(json.dumps(kept, indent=1) + "\n")


if __name__ == "__main__":
    main()
