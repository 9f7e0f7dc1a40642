"""Starting the tensor-parallel ranks and making them agree before anything is allocated.

A node's first rank (the server's engine core, an offline `LLM`'s process, or `serve
--node-rank K`) starts the node's other ranks as `python -m tierserve.engine.worker` processes
(node_start.py; an engine core does so before its torch loads), then every rank joins one
torch.distributed group (gloo on CPU, NCCL on CUDA) at `--dist-init-addr`. Global rank 0 alone
decides the start-up sizes (`agree`) and each step's inputs (`bus.py`); the server's API process
above it keeps HTTP and text. A rank that dies takes the others with it: the first process of a
node watches the ranks it started, and those watch it.

One group per process (torch's default group): a second engine is refused until the first is
closed, and a start that fails ends the ranks it started and leaves the group at once.
"""

from __future__ import annotations

import gc
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from tierserve.args import EngineArgs
from tierserve.distributed.bus import CommandBus
from tierserve.distributed.node_start import NodeRanks, spawn_node_ranks
from tierserve.errors import TierserveError
from tierserve.layers import DPAttention, TPGroup, set_dp_attention, set_tp_group

# Collectives of the model and the start-up rendezvous give up after this.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

T = TypeVar("T")

# The tp_size of the engine whose group this process is in, if one is open.
_open_tp: int | None = None
_open_lock = threading.Lock()


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    bus: CommandBus
    session: str  # rank 0's name for this launch
    node: NodeRanks  # the ranks this process started, and where every rank meets
    dp: DPAttention | None = None  # data-parallel attention: this rank's group among them
    released: bool = field(default=False, init=False, repr=False)

    @property
    def workers(self) -> list[subprocess.Popen]:
        return self.node.workers

    @property
    def closing(self) -> threading.Event:
        return self.node.closing

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def group_leader(self) -> bool:
        """The first rank of its attention group (of the node's only group without DP)."""
        return self.rank % (self.dp.group_size if self.dp is not None else self.world) == 0

    @classmethod
    def start(cls, args: EngineArgs, device: torch.device, node: NodeRanks | None = None) -> Ranks:
        """This process's rank in the group, started and joined; blocks until every rank has.
        `device` is where the engine runs (NCCL on CUDA, gloo elsewhere); `node`: the node's
        ranks when this process started them already (an engine core: node_start.py), which a
        refused claim leaves to the caller. Anything that fails after the claim ends the
        node's ranks before it is raised."""
        _claim_group(args.tp_size)
        try:
            node = node or spawn_node_ranks(args)
            _join(args, node.rank, node.addr, device.type == "cuda")
            dp = _attention_groups(args, node.rank)
            bus = CommandBus(node.rank, dp.group_size if dp is not None else args.tp_size)
            session = bus.session()
        except BaseException:
            _release(node, wait_s=0.0)
            raise
        rank = node.rank
        return cls(rank, args.tp_size, rank % args.local_ranks, bus, session, node, dp)

    def agree(self, decide: Callable[[], T]) -> T:
        """Rank 0's `decide()`, on every rank; or its refusal, raised on every rank (rank 0's
        caller prints it once)."""
        outcome: tuple | None = None
        if self.leader:
            try:
                outcome = ("ok", decide())
            except TierserveError as err:
                outcome = ("refused", err.message, err.field)
        kind, *rest = self.bus.share(outcome)  # type: ignore[misc]
        if kind == "refused":
            raise TierserveError(rest[0], rest[1])
        return rest[0]

    def close(self, timeout_s: float = 30.0) -> None:
        """Rank 0, once the others were told to stop: wait for the ranks this process started
        (ending those still there after `timeout_s`), then leave the group. Idempotent, and
        safe from a finalizer or at interpreter exit."""
        if self.released:
            return
        self.released = True
        _release(self.node, timeout_s)

    def kill(self) -> None:
        """A start or a stop that failed: the ranks this process started are ended at once
        (they may wait in a collective that will never come), then the group is left."""
        self.close(timeout_s=0.0)


def _claim_group(tp_size: int) -> None:
    """Refuse a second group before any rank is spawned: torch holds one default group per
    process, and a second init fails only after the ranks are running. (An engine core, the
    only engine of its process, has spawned its ranks already: node_start.py.)"""
    global _open_tp
    if _open_tp is not None:
        gc.collect()  # an engine in a reference cycle that nobody holds closes in its finalizer
    with _open_lock:
        if _open_tp is not None:
            raise TierserveError(
                "a tensor-parallel engine is already open in this process "
                f"(tp_size {_open_tp}); close it first: llm.close(), or use `with LLM(...)`",
                field="tp_size",
            )
        if dist.is_initialized():
            raise TierserveError(
                "torch.distributed's default process group is already initialized in this "
                "process; tensor parallelism needs its own: torch.distributed."
                "destroy_process_group() first",
                field="tp_size",
            )
        _open_tp = tp_size


def _join(args: EngineArgs, rank: int, addr: str, cuda: bool) -> None:
    local = args.local_ranks
    if cuda:
        torch.cuda.set_device(rank % local)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{addr}",
        rank=rank,
        world_size=args.tp_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    set_tp_group(TPGroup(rank, args.tp_size))


def _attention_groups(args: EngineArgs, rank: int) -> DPAttention | None:
    """With data-parallel attention: one process group per attention group (neighbouring
    ranks, as SGLang lays them out), made by every rank in the same order."""
    if not args.enable_dp_attention:
        return None
    size, dp_size = args.attention_tp_size, args.dp_size
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(dp_size)]
    # A rank's peers: the ranks at its position in every group, whose hidden states it gathers.
    peers = [dist.new_group(list(range(p, args.tp_size, size))) for p in range(size)]
    mine = rank // size
    set_tp_group(TPGroup(rank, args.tp_size), TPGroup(rank % size, size, groups[mine]))
    dp = DPAttention(dp_size, mine, size, peers[rank % size] if size > 1 else None)
    set_dp_attention(dp)
    return dp


def _release(node: NodeRanks | None, wait_s: float) -> None:
    """Reap the ranks this process started (killing any still there after `wait_s`), leave
    the group and free the process for another engine."""
    global _open_tp
    try:
        if node is not None:
            node.release(wait_s)
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        set_tp_group(TPGroup())  # a model built after this in the process is whole again
        set_dp_attention(None)
        with _open_lock:
            _open_tp = None
