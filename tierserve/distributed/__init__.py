"""Tensor parallelism across processes: the ranks, how they start and meet, and what rank 0
tells the others each step (docs/distributed.md)."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.distributed.node_start import NodeStart, start_node
    from tierserve.distributed.omp_wait import describe_wait, set_wait_here, wait_env
    from tierserve.distributed.placement import Pinned, Placement, pin, pin_rank, resolve_placement
    from tierserve.distributed.rank_env import (
        ENV_ARGS,
        ENV_PARENT,
        die_with_parent,
        exit_after,
        global_rank,
        start_from_lasting_thread,
    )
    from tierserve.distributed.ranks import Ranks

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "ENV_ARGS": "rank_env",
    "ENV_PARENT": "rank_env",
    "NodeStart": "node_start",
    "Pinned": "placement",
    "Placement": "placement",
    "Ranks": "ranks",
    "die_with_parent": "rank_env",
    "exit_after": "rank_env",
    "global_rank": "rank_env",
    "pin": "placement",
    "pin_rank": "placement",
    "resolve_placement": "placement",
    "start_from_lasting_thread": "rank_env",
    "start_node": "node_start",
    "describe_wait": "omp_wait",
    "set_wait_here": "omp_wait",
    "wait_env": "omp_wait",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
