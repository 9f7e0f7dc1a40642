"""Starting the tensor-parallel ranks and making them agree before anything is allocated.

The process a user starts is its node's first rank: it starts the node's other ranks as
`python -m tierserve.distributed.worker` processes, then every rank joins one
torch.distributed group (gloo on CPU, NCCL on CUDA) at `--dist-init-addr`. Global rank 0 keeps
HTTP, tokenization and detokenization; it alone decides the start-up sizes (`agree`) and each
step's inputs (`bus.py`). A rank that dies takes the others with it: the first process of a node
watches the ranks it started, and those watch it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from tierserve.config import EngineArgs
from tierserve.distributed.bus import CommandBus
from tierserve.engine.startup import resolve_device
from tierserve.errors import TierserveError
from tierserve.layers.parallel import TPGroup, set_tp_group
from tierserve.net import free_port

logger = logging.getLogger("tierserve")

ENV_RANK = "TIERSERVE_RANK"
ENV_ADDR = "TIERSERVE_DIST_ADDR"
ENV_ARGS = "TIERSERVE_ENGINE_ARGS"
# Collectives of the model and the start-up rendezvous give up after this.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# A rank that died: its peers' collectives fail at once (closed sockets) and the server answers
# 503 and exits by itself; if anything still waits after this, the process is ended.
DEATH_GRACE_S = 5.0

T = TypeVar("T")


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    bus: CommandBus
    session: str  # rank 0's name for this launch
    workers: list[subprocess.Popen] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)
    threads: int = 0  # torch's CPU threads before this rank took its share of the cores

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, args: EngineArgs) -> Ranks:
        """This process's rank in the group, started and joined; blocks until every rank has."""
        local = args.local_ranks
        workers: list[subprocess.Popen] = []
        closing = threading.Event()
        if ENV_RANK in os.environ:
            rank, addr = int(os.environ[ENV_RANK]), os.environ[ENV_ADDR]
            _exit_with_parent()
        else:  # the node's first process: start the node's other ranks
            rank = args.node_rank * local
            addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
            workers = [_spawn(args, rank + i, addr) for i in range(1, local)]
            _watch(workers, closing)  # from now: a rank that dies, even before meeting, ends us
        cuda = resolve_device(args.device).type == "cuda"
        threads = torch.get_num_threads()
        if cuda:
            torch.cuda.set_device(rank % local)
        else:  # the node's ranks share its cores: more threads than cores only contend
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{addr}",
            rank=rank,
            world_size=args.tp_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        set_tp_group(TPGroup(rank, args.tp_size))
        bus = CommandBus(rank)
        session = bus.session()
        return cls(rank, args.tp_size, rank % local, bus, session, workers, closing, threads)

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
        """Rank 0: the others have been told to stop; wait for the ones this process started."""
        self.closing.set()
        deadline = time.monotonic() + timeout_s
        for i, worker in enumerate(self.workers, start=self.rank + 1):
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
            logger.info("rank %d exited with status %s", i, worker.wait())
        if dist.is_initialized():
            dist.destroy_process_group()
        set_tp_group(TPGroup())  # a model built after this in the process is whole again
        torch.set_num_threads(self.threads)


def _spawn(args: EngineArgs, rank: int, addr: str) -> subprocess.Popen:
    env = {
        **os.environ,
        ENV_RANK: str(rank),
        ENV_ADDR: addr,
        ENV_ARGS: json.dumps(dataclasses.asdict(args)),
    }
    cmd = [sys.executable, "-m", "tierserve.distributed.worker"]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def _watch(workers: list[subprocess.Popen], closing: threading.Event) -> None:
    """End this process soon after a rank it started dies (unless it is being closed)."""

    def run() -> None:
        while True:
            for worker in workers:
                code = worker.poll()
                if code is not None and not closing.is_set():
                    if code != 2:  # 2: a start-up refusal, which rank 0 reports itself
                        logger.error("a tensor-parallel rank exited with status %s", code)
                    time.sleep(DEATH_GRACE_S)
                    if not closing.is_set():
                        os._exit(1 if code != 2 else 2)
                    return
            time.sleep(0.2)

    threading.Thread(target=run, name="tierserve-rank-watch", daemon=True).start()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=run, name="tierserve-parent-watch", daemon=True).start()
