"""Waiting for a whole response while watching the client: a client that leaves aborts the
requests it asked for, streaming or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


async def unless_disconnected(
    work: Awaitable[T], outputs: AsyncGenerator[Any, None], request: Request
) -> T | None:
    """`work`'s result, or None if the client disconnects first; then `outputs` is closed,
    which aborts its requests and frees their KV."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await outputs.aclose()
                return None
            await asyncio.wait({task}, timeout=0.25)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
