"""Sizes, computed once: KV bytes per token (kv.py), pool sizes (pools.py) and a speculative
draft's memory (draft.py), the pure arithmetic `tierserve plan` and `tierserve serve` both call."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.sizing.draft import DraftSize
    from tierserve.sizing.kv import (
        KVBytes,
        KVSpec,
        kv_bytes,
        kv_dtype_name,
        kv_spec,
        override_per_rank,
        pages_for,
        short_kv_dtype,
    )
    from tierserve.sizing.pools import (
        DEFAULT_MARGIN,
        DEFAULT_OVERHEAD_PER_RANK,
        HostBudget,
        HostRequest,
        HostSizing,
        device_pool_bytes,
        host_request,
        local_ranks,
        size_host_cache,
        tokens_in,
        weights_per_rank,
    )

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "DEFAULT_MARGIN": "pools",
    "DEFAULT_OVERHEAD_PER_RANK": "pools",
    "DraftSize": "draft",
    "HostBudget": "pools",
    "HostRequest": "pools",
    "HostSizing": "pools",
    "KVBytes": "kv",
    "KVSpec": "kv",
    "device_pool_bytes": "pools",
    "host_request": "pools",
    "kv_bytes": "kv",
    "kv_dtype_name": "kv",
    "kv_spec": "kv",
    "local_ranks": "pools",
    "override_per_rank": "kv",
    "pages_for": "kv",
    "short_kv_dtype": "kv",
    "size_host_cache": "pools",
    "tokens_in": "pools",
    "weights_per_rank": "pools",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
