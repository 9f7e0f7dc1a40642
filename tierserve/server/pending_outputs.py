"""A request's outputs on their way from the engine core's reader to the request's consumer
(its stream or its whole response), on the consumer's event loop."""

from __future__ import annotations

import asyncio

from tierserve.outputs import RequestOutput


class PendingOutputs:
    """One request's outputs that its consumer has not taken yet, joined as they arrive: a
    consumer that falls behind (a slow client, a busy CPU, several decode steps a message)
    takes them as one output and sends one chunk, not one each. vLLM's output collector joins
    a slow consumer's outputs the same way. An error is taken after the outputs before it.

    `stream_interval` (vLLM's and SGLang's `--stream-interval`): the consumer wakes for the
    first token, then once `stream_interval` tokens have joined since what it took, and for
    the last; so a stream's client reads one chunk per that many tokens."""

    def __init__(self, stream_interval: int = 1) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._interval = stream_interval
        self._taken_tokens: int | None = None  # output tokens the consumer has had; None: none

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
            self._ready.set()
            return
        self._output = item if self._output is None else self._output.then(item)
        if self._due(self._output):
            self._ready.set()

    def _due(self, output: RequestOutput) -> bool:
        taken = self._taken_tokens
        return (
            output.finished or taken is None or output.num_output_tokens - taken >= self._interval
        )

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        item: RequestOutput | BaseException | None = self._output or self._error
        self._output = None
        if isinstance(item, RequestOutput):
            self._taken_tokens = item.num_output_tokens
        if self._error is None:
            self._ready.clear()
        assert item is not None
        return item
