"""The storage tier's knobs (`--hicache-storage-backend-extra-config` and the prefetch flags),
checked once at start-up, and the buffers they bound."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD
from tierserve.storage.prefetch_policy import DEFAULT_POLICY, PREFETCH_POLICIES
from tierserve.storage.registry import backend_class

FETCHERS = 2  # prefetches that run at once
FETCH_AHEAD = 2  # batches a prefetch fetches before the engine has placed the earlier ones


@dataclass(frozen=True)
class StorageConfig:
    """The tier's knobs; all but the backend's own come from the extra config JSON too."""

    backend: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: str = DEFAULT_POLICY
    timeout_s: float = 2.0  # per call into the store
    prefetch_threshold: int = 256  # tokens; a shorter miss is recomputed
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_timeout_max: float = 10.0
    prefetch_read_bytes_per_s: float = 0.0  # auto's rates, pinned; 0: measured
    prefetch_recompute_tokens_per_s: float = 0.0
    write_queue_bytes: int = 256 * 2**20  # pages waiting to be written, at most
    batch_pages: int = 64
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    close_timeout_s: float = 2.0  # at shutdown, for the store's client teardown (tier.py)
    miss_ttl_s: float = 1.0  # a page a prefetch stopped at is not asked for again this soon
    namespace: str = ""  # a salt: servers with different salts never share pages

    @classmethod
    def parse(
        cls, backend: str, extra_json: str | None, policy: str = DEFAULT_POLICY
    ) -> StorageConfig:
        try:
            extra = json.loads(extra_json) if extra_json else {}
        except ValueError as err:
            raise TierserveError(f"storage extra config is not JSON: {err}", EXTRA_FIELD) from None
        if not isinstance(extra, dict):
            raise TierserveError("storage extra config must be a JSON object", EXTRA_FIELD)
        if policy not in PREFETCH_POLICIES:
            raise TierserveError(
                f"prefetch policy {policy!r}; known: {', '.join(PREFETCH_POLICIES)}",
                "hicache_storage_prefetch_policy",
            )
        for name, flag in _FLAGS.items():
            if name in extra:
                message = f"{name!r} is not a storage config key: give {flag}"
                raise TierserveError(message, EXTRA_FIELD)
        ours = {k: extra.pop(k) for k in list(extra) if k in cls.__dataclass_fields__}
        for name, value in ours.items():
            _check_field(name, value)
        store = backend_class(backend)
        unknown = sorted(set(extra) - store.config_keys) if store.config_keys is not None else []
        if unknown:
            known = ", ".join(sorted(store.config_keys or ())) or "none"
            message = (
                f"unknown key {unknown[0]!r} in the {backend} storage config (the backend's: "
                f"{known}; the tier's: {', '.join(sorted(_TIER_KEYS))})"
            )
            raise TierserveError(message, EXTRA_FIELD)
        store.check_config(extra)
        return cls(backend, extra, policy, **ours)

    def buffer_bytes(self, bytes_per_page: int) -> int:
        """RAM the tier itself holds at most: the write queue, and the pages fetched and not
        placed yet (each fetcher runs FETCH_AHEAD batches ahead of the engine)."""
        return self.write_queue_bytes + FETCHERS * FETCH_AHEAD * self.batch_pages * bytes_per_page

    def wait_limit(self, tokens: int) -> float:
        """timeout policy: seconds a request waits for a prefetch of `tokens` tokens."""
        limit = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(self.prefetch_timeout_max, limit)


# The config's own fields that flags give, not the extra config.
_FLAGS = {
    "backend": "--hicache-storage-backend",
    "prefetch_policy": "--hicache-storage-prefetch-policy",
    "extra": "the backend's keys at the top level",
}
_TIER_KEYS = set(StorageConfig.__dataclass_fields__) - set(_FLAGS)
# Past these a second overflows the clock's types (threading's TIMEOUT_MAX is ~9.2e9 s), and
# every storage call failed.
_MAX_SECONDS = 1e6
_SECONDS = ("timeout_s", "prefetch_timeout_base", "prefetch_timeout_max", "breaker_cooldown_s",
            "close_timeout_s", "miss_ttl_s")  # fmt: skip
# Fields that count things: whole numbers >= 1. The rest are seconds or tokens, >= 0.
_COUNTS = ("write_queue_bytes", "batch_pages", "breaker_failures")


def _check_field(name: str, value: Any) -> None:
    if name == "namespace":
        if not isinstance(value, str):
            raise TierserveError("namespace in the storage config must be a string", EXTRA_FIELD)
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise TierserveError(f"{name} in the storage config must be >= 0", EXTRA_FIELD)
    if name in _COUNTS and (not isinstance(value, int) or value < 1):
        raise TierserveError(f"{name} in the storage config must be an int >= 1", EXTRA_FIELD)
    if name == "timeout_s" and value == 0:
        raise TierserveError("timeout_s in the storage config must be > 0", EXTRA_FIELD)
    if name in _SECONDS and not value < _MAX_SECONDS:
        message = f"{name} in the storage config must be < {_MAX_SECONDS:g} seconds, got {value}"
        raise TierserveError(message, EXTRA_FIELD)
