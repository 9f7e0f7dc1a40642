"""The storage backends, by the name `--hicache-storage-backend` takes: each named here, once.

Tests and plugins may add their own with `register` (a decorator); nothing registers itself on
import, so reading this file tells every backend there is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import StorageBackend
from tierserve.storage.file import FileBackend
from tierserve.storage.mooncake import MooncakeBackend

STORAGE_BACKENDS: dict[str, type[StorageBackend]] = {
    "file": FileBackend,
    "mooncake": MooncakeBackend,  # its client library loads only when one starts
}


def register(name: str) -> Callable[[type[StorageBackend]], type[StorageBackend]]:
    def wrap(cls: type[StorageBackend]) -> type[StorageBackend]:
        cls.name = name
        STORAGE_BACKENDS[name] = cls
        return cls

    return wrap


def backend_class(name: str) -> type[StorageBackend]:
    if name not in STORAGE_BACKENDS:
        known = ", ".join(sorted(STORAGE_BACKENDS))
        raise TierserveError(
            f"unknown storage backend {name!r}; known: {known}", "hicache_storage_backend"
        )
    return STORAGE_BACKENDS[name]


def make_backend(name: str, extra: Mapping[str, Any]) -> StorageBackend:
    return backend_class(name)(extra)
