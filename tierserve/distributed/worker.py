"""A tensor-parallel rank other than 0: builds its engine (its shard of the model, its pools)
and runs the steps rank 0 announces until told to stop. Started by distributed/ranks.py.

A rank dies with the process that started it: on Linux the kernel sends it SIGKILL when the
thread that started it exits (set before torch loads: rank 0 may die while this rank sits in
the rendezvous, where no Python thread of its own gets to run); elsewhere a thread polls.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

# What rank 0 puts in a worker's environment (distributed/ranks.py writes them).
ENV_PARENT = "TIERSERVE_PARENT_PID"
ENV_ARGS = "TIERSERVE_ENGINE_ARGS"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main() -> int:
    _die_with_parent()  # first: the parent may already be gone, or go while torch loads
    import json
    import logging

    from tierserve.config import EngineArgs
    from tierserve.engine.engine import Engine
    from tierserve.errors import TierserveError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(message)s")
    args = EngineArgs(**json.loads(os.environ[ENV_ARGS]))
    try:
        engine = Engine(args)
    except TierserveError:
        return 2  # rank 0 refused the start-up and says why
    engine.follow()
    return 0


def _die_with_parent() -> None:
    parent = int(os.environ.get(ENV_PARENT, "0")) or os.getppid()
    if not _parent_death_signal():
        threading.Thread(target=_poll_parent, args=(parent,), daemon=True).start()
    # The parent may have died between our fork and the prctl: then nothing would send it.
    if os.getppid() != parent:
        os._exit(1)


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


if __name__ == "__main__":
    sys.exit(main())
