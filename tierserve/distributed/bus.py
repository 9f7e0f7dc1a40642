"""What rank 0 tells the other ranks before each step, so every rank's scheduler, radix tree and
KV tiers make the same decisions: requests that arrived, aborts, cache flushes, and whether to
step or stop. The engines are deterministic given these (the same requests in the same order,
the same seeds, the same logits after the LM head's all-gather), so only inputs travel, never
scheduling state. The messages are the engine's own (messages.py), msgpack-encoded and
broadcast over a gloo group that waits as long as the server idles; a rank that dies closes its
sockets and the broadcast fails."""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from tierserve.messages import BusMessage, EngineInput, decode_bus, encode

IDLE_TIMEOUT = timedelta(days=7)  # a follower waits this long for rank 0's next message


class CommandBus:
    def __init__(self, rank: int) -> None:
        self.leader = rank == 0
        self._group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._pending: list[EngineInput] = []

    def post(self, command: EngineInput) -> None:
        if self.leader:
            self._pending.append(command)

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Each flag ANDed over the ranks (a copy has landed everywhere)."""
        t = torch.tensor(flags, dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return [bool(x) for x in t.tolist()]

    def share(self, value: object) -> object:
        """Rank 0's `value` on every rank (the others pass None)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def session(self) -> str:
        """A name rank 0 picks for this launch (shared-memory segments are named after it)."""
        return str(self.share(uuid.uuid4().hex[:16] if self.leader else None))

    def exchange(self, step: bool = False, stop: bool = False) -> BusMessage:
        """Rank 0 sends what happened since the last exchange; the others receive it."""
        data = None
        if self.leader:
            data, self._pending = encode(BusMessage(self._pending, step, stop)), []
        received = self.share(data)
        assert isinstance(received, bytes)
        return decode_bus(received)
