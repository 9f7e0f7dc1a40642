"""The storage tier under the host tier: backends by name, content keys, checked page objects,
background writes and prefetches (docs/kv-cache.md)."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.storage.backend import EXTRA_FIELD
    from tierserve.storage.config import StorageConfig
    from tierserve.storage.keys import Namespace, shard_of
    from tierserve.storage.mooncake import MooncakeMaster
    from tierserve.storage.prefetch import RankRoles
    from tierserve.storage.prefetch_policy import PrefetchRates
    from tierserve.storage.registry import backend_class
    from tierserve.storage.tier import StorageTier

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "EXTRA_FIELD": "backend",
    "MooncakeMaster": "mooncake",
    "Namespace": "keys",
    "shard_of": "keys",
    "PrefetchRates": "prefetch_policy",
    "RankRoles": "prefetch",
    "StorageConfig": "config",
    "StorageTier": "tier",
    "backend_class": "registry",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
