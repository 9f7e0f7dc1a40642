"""How torch's OpenMP threads wait at a join: set once for the engine's processes, unless the
user set it.

libgomp's threads spin up to GOMP_SPINCOUNT times (300,000 by default) at the end of each
parallel region before they sleep. Alone on a host that wakes them fastest, but two servers on
one host (replicas behind a router, a test run beside a server) each spin on the cores the
other needs. On this project's 2-core EPYC (benchmarks/results/omp-wait/, two runs), two servers
under 32 streams each streamed together 0.32-0.39x what one streamed alone at libgomp's default,
0.76x at 10,000 spins and 1.06-1.13x at 3,000, which cost 1.03-1.13x on the offline batch-64
decode step and 0.85-0.91x on one server's 32 streams alone (noisy: spin's own rounds spread
1,320-1,626 tok/s). OMP_WAIT_POLICY=PASSIVE reached 1.28-1.33x but made that step 1.44-1.53x.

libgomp reads these variables once, when torch loads it: the engine core and its ranks get
them in the environment they start with; the offline `LLM` sets them in its own process only
while torch is not loaded yet.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger("tierserve")

# Either one set by the user means the user chose: tierserve adds nothing.
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_WAIT = {"GOMP_SPINCOUNT": "3000"}


def wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to the environment of an engine process started from `environ`."""
    if any(name in environ for name in WAIT_VARS):
        return {}
    return dict(DEFAULT_WAIT)


def describe_wait(environ: Mapping[str, str]) -> str:
    """The start-up table's line, from an engine process's environment (where `wait_env` has
    been applied already): how its threads wait, and who chose it."""
    chosen = {name: environ[name] for name in WAIT_VARS if name in environ}
    if not chosen:  # an offline LLM whose caller imported torch first
        return "libgomp's default, spinning up to 300,000 times (torch was loaded first)"
    spelled = ", ".join(f"{k}={v}" for k, v in chosen.items())
    whose = "tierserve's default" if chosen == DEFAULT_WAIT else "from the environment"
    return f"{spelled} ({whose}; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)"


_warned = False


def set_wait_here() -> None:
    """For an engine in this process (the offline `LLM`): the default, if torch has not loaded
    libgomp yet; a warning (once) if it has and the user chose nothing: it is too late then."""
    global _warned
    added = wait_env(os.environ)
    if not added or _warned:
        return
    if "torch" in sys.modules:
        _warned = True
        logger.warning(
            "torch was imported before tierserve's LLM: its OpenMP threads spin at each join "
            "(libgomp's default), which slows other busy processes on this host; set %s "
            "before importing torch, or OMP_WAIT_POLICY to keep libgomp's choice",
            ", ".join(f"{k}={v}" for k, v in added.items()),
        )
        return
    os.environ.update(added)
