"""What rank 0 tells the other ranks before each step, so every rank's scheduler, radix tree and
KV tiers make the same decisions: requests that arrived, aborts, cache flushes, and whether to
step or stop. The engines are deterministic given these (the same requests in the same order,
the same seeds, the same logits after the LM head's all-gather), so only inputs travel, never
scheduling state. The messages are the engine's own (core_messages.py), msgpack-encoded and
broadcast over a gloo group that waits as long as the server idles; a rank that dies closes its
sockets and the broadcast fails.

With data-parallel attention the same holds inside each attention group: every input reaches
every rank, a request is taken by the ranks of the group it names, and after each step the
groups' first ranks send rank 0 what their group produced (`collect`)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from tierserve.core_messages import BusMessage, EngineInput, decode_bus, encode

IDLE_TIMEOUT = timedelta(days=7)  # a follower waits this long for rank 0's next message


class CommandBus:
    def __init__(self, rank: int, group_size: int) -> None:
        self.leader = rank == 0
        group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        self._group = group
        self._pending: list[EngineInput] = []
        # The ranks of this rank's attention group (every rank without DP attention), for
        # what they alone must agree on; made by every rank, in the same order.
        world = dist.get_world_size()
        self._attention = self._group
        if group_size < world:
            for first in range(0, world, group_size):
                ranks = list(range(first, first + group_size))
                made = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
                if rank in ranks:  # else `made` is GroupMember.NON_GROUP_MEMBER
                    assert isinstance(made, dist.ProcessGroup)
                    self._attention = made

    def post(self, command: EngineInput) -> None:
        if self.leader:
            self._pending.append(command)

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def group_barrier(self) -> None:
        """The ranks of this rank's attention group meet (every rank without DP attention)."""
        dist.barrier(group=self._attention)

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Each flag ANDed over the ranks of this rank's attention group (a copy has landed
        on every rank that holds it)."""
        return [bool(x) for x in self.all_min([int(f) for f in flags])]

    def all_min(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks of this rank's attention group (the pages every
        rank has fetched; the first rank's verdict, where the others send a large number)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._attention)
        return t.tolist()

    def collect(self, value: bytes | None) -> list[bytes | None]:
        """Every rank's `value` on rank 0, in rank order (the others get [])."""
        out: list | None = [None] * dist.get_world_size() if self.leader else None
        dist.gather_object(value, out, dst=0, group=self._group)
        return out or []

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
