"""What a node's first process decides and starts before its own torch loads: where the node's
processes compute (placement.py) and the node's other ranks, as `python -m
tierserve.engine.worker` processes.

Light on purpose (no torch): a TP server's engine core starts its ranks first thing, so that
their imports run beside its own. It once spawned them only after its ~2.7 s of imports (torch,
the engine), and a TP=2 server's ranks imported one after the other. An offline `LLM` starts
them from `Ranks.start` instead, once it has checked that its process holds no other group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from tierserve.args import EngineArgs
from tierserve.distributed.omp_wait import wait_env
from tierserve.distributed.placement import Placement, resolve_placement
from tierserve.distributed.rank_env import (
    ENV_ADDR,
    ENV_ARGS,
    ENV_PARENT,
    ENV_RANK,
    global_rank,
    start_from_lasting_thread,
)
from tierserve.utils import free_port

logger = logging.getLogger("tierserve")

# A rank that died: its peers' collectives fail at once (closed sockets) and the server answers
# 503 and exits by itself; if anything still waits after this, the process is ended.
DEATH_GRACE_S = 5.0


@dataclass
class NodeRanks:
    """The ranks a node's first process started (none in a worker rank), the address every
    rank meets at, and the event that tells its watchers the ranks are ended on purpose."""

    addr: str
    rank: int  # this process's global rank
    workers: list[subprocess.Popen] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)

    def dead(self, wait_s: float = 1.0) -> str | None:
        """Which rank started here has ended, waited for up to `wait_s`: a collective fails
        (a reset socket) a moment before its peer's exit is seen."""
        deadline = time.monotonic() + wait_s
        while (found := _first_ended(self.workers, self.rank)) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        rank, code = found
        return f"tensor-parallel rank {rank} {_ended(code)}"

    def release(self, wait_s: float) -> None:
        """Reap the ranks started here, killing any still there after `wait_s`."""
        self.closing.set()  # first: a rank ended on purpose must not take this process with it
        deadline = time.monotonic() + wait_s
        killed = set()
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                killed.add(worker.pid)
        for i, worker in enumerate(self.workers, start=self.rank + 1):
            code = worker.wait()
            if worker.pid in killed:  # its status would be -9, which reads as a crash
                logger.info("rank %d stopped by rank %d", i, self.rank)
            else:
                logger.info("rank %d %s", i, _ended(code))


@dataclass(frozen=True)
class NodeStart:
    """A node's first process's start: its args carrying the placement's explicit lists to the
    node's other processes, the placement, and the ranks when they were started here."""

    args: EngineArgs
    placement: Placement
    ranks: NodeRanks | None = None


def start_node(args: EngineArgs, serving: bool, spawn_ranks: bool) -> NodeStart:
    """The node's placement decided and, with `spawn_ranks` under tensor parallelism, its
    other ranks started (watched from now: one that dies ends this process)."""
    args, placement = resolve_placement(args, serving)
    ranks = spawn_node_ranks(args) if spawn_ranks and args.tp_size > 1 else None
    return NodeStart(args, placement, ranks)


def spawn_node_ranks(args: EngineArgs) -> NodeRanks:
    """The node's ranks after this process's own, started and watched; a worker rank (one
    started so) starts none and meets at the address it was given."""
    rank = global_rank(args)
    if ENV_RANK in os.environ:  # worker.py made this rank die with its parent
        return NodeRanks(os.environ[ENV_ADDR], rank)
    addr, closing = args.dist_init_addr or f"127.0.0.1:{free_port()}", threading.Event()
    workers = _spawn_ranks(args, rank, addr, closing)
    _watch(workers, rank, closing)  # from now: a rank that dies, even before meeting, ends us
    return NodeRanks(addr, rank, workers, closing)


def _spawn_ranks(
    args: EngineArgs, rank: int, addr: str, closing: threading.Event
) -> list[subprocess.Popen]:
    """Ranks rank + 1 … of this node, started from a thread that outlives them (their
    parent-death signal is tied to the thread that forks them: rank_env.py)."""

    def start() -> list[subprocess.Popen]:
        workers: list[subprocess.Popen] = []
        try:
            for i in range(1, args.local_ranks):
                workers.append(_spawn(args, rank + i, addr))
        except BaseException:
            for worker in workers:
                worker.kill()
                worker.wait()
            raise
        return workers

    def outlive(workers: list[subprocess.Popen]) -> None:
        closing.wait()
        for worker in workers:  # release() reaps them too; this thread only has to outlive them
            worker.wait()

    return start_from_lasting_thread(start, outlive, "tierserve-rank-spawner")


def _first_ended(workers: list[subprocess.Popen], rank: int) -> tuple[int, int] | None:
    """The rank number and exit status of the first of `workers` (the ranks after `rank`)
    that has ended; None while all run."""
    for i, worker in enumerate(workers, start=rank + 1):
        if (code := worker.poll()) is not None:
            return i, code
    return None


def _ended(code: int) -> str:
    """A rank's exit status as a person reads it: "was killed by SIGKILL", not -9."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _spawn(args: EngineArgs, rank: int, addr: str) -> subprocess.Popen:
    env = {
        **os.environ,
        **wait_env(os.environ),  # an offline LLM's ranks too, whatever its own torch does
        ENV_RANK: str(rank),
        ENV_ADDR: addr,
        ENV_ARGS: json.dumps(dataclasses.asdict(args)),
        ENV_PARENT: str(os.getpid()),
    }
    cmd = [sys.executable, "-m", "tierserve.engine.worker"]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def _watch(workers: list[subprocess.Popen], rank: int, closing: threading.Event) -> None:
    """End this process soon after a rank it started dies (unless it is being closed)."""

    def run() -> None:
        while not closing.is_set():
            found = _first_ended(workers, rank)
            if found is not None and not closing.is_set():
                i, code = found
                if code != 2:  # 2: a start-up refusal, which rank 0 reports itself
                    logger.error("tensor-parallel rank %d %s", i, _ended(code))
                if not closing.wait(DEATH_GRACE_S):
                    os._exit(1 if code != 2 else 2)
                return
            closing.wait(0.2)

    threading.Thread(target=run, name="tierserve-rank-watch", daemon=True).start()
