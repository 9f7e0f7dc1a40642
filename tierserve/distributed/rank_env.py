"""What rank 0 puts in a worker rank's environment, and how a worker dies with rank 0.

Light on purpose (no torch): a worker arms its parent-death signal before anything heavy loads.
A rank dies with the process that started it: on Linux the kernel sends it SIGKILL when the
thread that started it exits (set before torch loads: rank 0 may die while this rank sits in
the rendezvous, where no Python thread of its own gets to run); elsewhere a thread polls.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

if TYPE_CHECKING:
    from tierserve.args import EngineArgs

T = TypeVar("T")

ENV_RANK = "TIERSERVE_RANK"
ENV_ADDR = "TIERSERVE_DIST_ADDR"
ENV_ARGS = "TIERSERVE_ENGINE_ARGS"
ENV_PARENT = "TIERSERVE_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def global_rank(args: EngineArgs) -> int:
    """This process's rank: a worker's is in its environment, a node's first process has its
    node's first rank (global rank 0 serves HTTP; the others follow it). Here, not beside the
    ranks' torch code: a TP server's API process asks before it spawns its engine core."""
    return int(os.environ.get(ENV_RANK, args.node_rank * args.local_ranks))


def die_with_parent() -> None:
    parent = int(os.environ.get(ENV_PARENT, "0")) or os.getppid()
    if not _parent_death_signal():
        threading.Thread(target=_poll_parent, args=(parent,), daemon=True).start()
    # The parent may have died between our fork and the prctl: then nothing would send it.
    if os.getppid() != parent:
        os._exit(1)


def exit_after(code: int) -> NoReturn:
    """End an engine core or rank with its main's `code`, its logs and output flushed, without
    Python's teardown: unloading torch's modules took ~0.5 s of every server's and rank's stop.
    Every way out of main has closed its store's client first (a closed engine, a refused or
    failed start, a failed loop), so nothing is left for a client library's exit handler, which
    for a client left open by a dead store (storage/tier.py) would wait out its timeouts."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc to call, or one without prctl
        return False


def _poll_parent(parent: int) -> None:
    """The fallback: it cannot run while the main thread holds the GIL in C++ (the
    rendezvous), so a rank may outlive its parent by that long."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def start_from_lasting_thread(start: Callable[[], T], outlive: Callable[[T], None], name: str) -> T:
    """`start()`'s result, from a daemon thread that then runs `outlive(result)`: a child's
    parent-death signal fires when the *thread* that forked it exits, so the processes `start`
    forks must not be forked by the caller's thread (a notebook's, an executor's), and
    `outlive` must wait at least as long as they run. What `start` raises is raised here."""
    handed: queue.SimpleQueue[tuple[bool, object]] = queue.SimpleQueue()

    def run() -> None:
        try:
            result = start()
        except BaseException as err:
            handed.put((False, err))
            return
        handed.put((True, result))
        outlive(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    ok, got = handed.get()
    if not ok:
        raise got  # type: ignore[misc]
    return got  # type: ignore[return-value]
