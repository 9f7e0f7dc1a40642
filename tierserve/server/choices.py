"""Several choices in one response: `n` > 1, or a batch of prompts in /v1/completions.

Each choice is its own engine request, tagged `<response id>-<index>`; choice `j × n + i` is
sample `i` of prompt `j` (OpenAI's order). The first sample of a prompt runs alone until its
first token: by then its prompt is in the radix cache, so the other samples start from it and
the prompt is prefilled once. With a seed, sample `i` uses seed + i (mod 2**63): the choices
equal single requests with those seeds. Usage counts each prompt once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tierserve.errors import TierserveError
from tierserve.outputs import RequestOutput
from tierserve.sampling_params import SamplingParams
from tierserve.server.async_engine import EngineDeadError
from tierserve.server.disconnect import unless_disconnected
from tierserve.server.protocol import SSE_DONE, sse, usage
from tierserve.server.serving import Serving, off_the_loop, stream_error


@dataclass(frozen=True)
class Job:
    index: int
    prompt: str | list[int]
    params: SamplingParams
    after: int | None  # the choice whose prefill this one waits for


def jobs(prompts: list[str | list[int]], params: SamplingParams, n: int) -> list[Job]:
    out = []
    for j, prompt in enumerate(prompts):
        for i in range(n):
            # The prompt's first choice scores it for all (CompletionServing._echoed): the others
            # start from its cached prefix instead of each prefilling it whole again.
            out.append(Job(j * n + i, prompt, params.sample(i), None if i == 0 else j * n))
    return out


async def merged(c: Serving, todo: list[Job]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Every choice's outputs as they come, tagged with its index; the first error raises."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
    started = {job.index: asyncio.Event() for job in todo}

    async def run(job: Job) -> None:
        try:
            if job.after is not None:
                await started[job.after].wait()
            async for out in c.tracked(job.prompt, job.params, f"{c.id}-{job.index}"):
                started[job.index].set()
                queue.put_nowait((job.index, out))
        except BaseException as err:  # handed to the consumer; a cancel ends the request
            started[job.index].set()
            queue.put_nowait((job.index, err))

    tasks = [asyncio.ensure_future(run(job)) for job in todo]
    try:
        finished = 0
        while finished < len(todo):
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished += item.finished
            yield index, item
    finally:  # an error or a client that left: every other choice is aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(finals: dict[int, RequestOutput], n: int) -> dict[str, Any]:
    leads = [out for index, out in finals.items() if index % n == 0]
    return usage(
        sum(out.prompt_tokens for out in leads),
        sum(out.num_output_tokens for out in finals.values()),
        sum(out.cached_tokens for out in leads),
    )


async def respond(c: Serving, todo: list[Job], n: int, request: Request, stream: bool) -> Response:
    outputs = merged(c, todo)
    # A bad prompt is a 400 here, before any byte is sent; a client that leaves ends its work.
    first = await unless_disconnected(anext(outputs), outputs, request)
    if first is None:
        return Response(status_code=499)
    if stream:
        return StreamingResponse(_sse(c, first, outputs, n), media_type="text/event-stream")
    finals = await _collect(first, outputs, request)
    if finals is None:
        return Response(status_code=499)  # the client went away: every choice aborted

    def body() -> dict[str, Any]:
        choices = [c.whole_choice(i, finals[i]) for i in sorted(finals)]
        body = c.envelope(c.object, choices, usage=total_usage(finals, n))
        return body | c.prompt_fields(finals[min(finals)])

    return await off_the_loop(body)


async def _collect(
    first: tuple[int, RequestOutput],
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    request: Request,
) -> dict[int, RequestOutput] | None:

    async def drain() -> dict[int, RequestOutput]:
        index, out = first
        finals = {index: out} if out.finished else {}
        async for index, out in outputs:  # only the finished outputs are kept
            if out.finished:
                finals[index] = out
        return finals

    return await unless_disconnected(drain(), outputs, request)


async def _sse(
    c: Serving,
    first: tuple[int, RequestOutput],
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    n: int,
) -> AsyncGenerator[bytes, None]:
    seen: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, out = item
            if out.text_delta or out.finished or index not in seen or c.logprobs:
                chunk = c.chunk(out, index not in seen, index)
                if chunk is not None:
                    yield sse(chunk)
                    seen.add(index)
            if out.finished:
                finals[index] = out
            try:
                item = await anext(outputs, None)
            except (EngineDeadError, TierserveError) as err:
                yield stream_error(err)
                return
        if c.include_usage:
            tail = c.envelope(c.chunk_object, [], usage=total_usage(finals, n))
            yield sse(tail)
        yield SSE_DONE
    finally:
        await outputs.aclose()
