"""A request's outputs on their way from the engine core's reader to the request's consumer
(its stream or its whole response), on the consumer's event loop."""

from __future__ import annotations

import asyncio

from tierserve.outputs import RequestOutput


class PendingOutputs:
    """One request's outputs that its consumer has not taken yet, joined as they arrive: a
    consumer that falls behind (a slow client, a busy CPU, several decode steps a message)
    takes them as one output and sends one chunk, not one each. vLLM's output collector joins
    a slow consumer's outputs the same way. An error is taken after the outputs before it."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._output = item if self._output is None else self._output.then(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        item: RequestOutput | BaseException | None = self._output or self._error
        self._output = None
        if self._error is None:
            self._ready.clear()
        assert item is not None
        return item
