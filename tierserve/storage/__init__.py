"""The storage tier under the host tier: backends by name, content keys, checked page objects,
background writes and prefetches (docs/kv-cache.md)."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
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
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
