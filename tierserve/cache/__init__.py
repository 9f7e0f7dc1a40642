"""The KV cache: page-major pools, the radix tree over the device and host tiers, copies between
them (docs/kv-cache.md)."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.cache.handle import KVHandle
    from tierserve.cache.manager import KVCacheManager, pair_keys
    from tierserve.cache.pool import PagedKV, check_pool_size
    from tierserve.cache.shared_host import HostShare, open_share
    from tierserve.cache.tiers import HostTier
    from tierserve.cache.transfer import TransferFactory, default_transfer

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
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
__getattr__ = lazy_exports(__name__, EXPORTS)
