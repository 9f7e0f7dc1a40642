"""The KV cache: page-major pools, the radix tree over the device and host tiers, copies between
them (docs/kv-cache.md)."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
    "HostShare": "shared_host",
    "HostTier": "tiers",
    "KVCacheManager": "manager",
    "pair_keys": "manager",
    "KVHandle": "handle",
    "PagedKV": "pool",
    "TransferFactory": "transfer",
    "check_pool_size": "pool",
    "default_transfer": "transfer",
    "open_share": "shared_host",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
