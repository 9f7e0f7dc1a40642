"""The storage backend interface: a key-value store of page objects, chosen by name
(`--hicache-storage-backend`). A backend only moves bytes; timeouts, retries, integrity and
keys are the storage tier's. A third store is one file: a subclass registered here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from tierserve.errors import TierserveError
from tierserve.utils import parse_size

EXTRA_FIELD = "hicache_storage_backend_extra_config"


def config_bytes(extra: Mapping[str, Any], key: str, default: int) -> int:
    """A size in the extra config: an int is bytes (Mooncake's convention), a string needs its
    unit ("200GB", "1GiB")."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TierserveError(f"{key} in the storage config must be bytes or a size", EXTRA_FIELD)
    if isinstance(value, int):
        if value < 0:
            raise TierserveError(f"{key} in the storage config must be >= 0", EXTRA_FIELD)
        return value
    if value.strip().replace(".", "", 1).isdigit():
        raise TierserveError(f"{key} {value!r} needs a unit (or give an int of bytes)", EXTRA_FIELD)
    return parse_size(value, key)


class StorageBackend(ABC):
    name: str = ""
    tears_down: bool = False  # close() talks to the store, so it may wait on a dead one
    # The extra config's keys this backend reads; another key is refused by name, never
    # ignored (a misspelt "pathh" once served from the default directory). None: any.
    config_keys: frozenset[str] | None = None

    def __init__(self, extra: Mapping[str, Any]) -> None:  # noqa: B027 (each reads its own)
        """A backend is made from the storage config's extra keys (`make_backend`)."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's object, None where there is none."""

    @abstractmethod
    def put(self, items: Mapping[str, bytes]) -> list[str]:
        """Store the objects; the keys of those it had no room for (a capped store): the tier
        counts them dropped, not written, and asks for them again never."""

    def close(self) -> None:  # noqa: B027 (optional)
        """Release what the backend holds (connections, segments)."""

    def answers(self) -> bool:
        """Whether the store answers now: asked before `close`, whose teardown may wait out
        a dead store's timeouts."""
        return True

    @classmethod  # noqa: B027 (optional)
    def check_config(cls, extra: Mapping[str, Any]) -> None:
        """Raise TierserveError for a value of this backend's keys that cannot be right, read
        from the config alone (serve, its dry run and plan all read the config through it)."""

    @classmethod
    def preflight(cls, extra: Mapping[str, Any]) -> None:
        """What the config gets wrong that the machine tells, without opening the store (a
        directory, a master that does not answer): `serve --dry-run` asks, and an open asks
        first where it would otherwise retry for long."""
        cls.check_config(extra)

    @classmethod
    def page_room(cls, extra: Mapping[str, Any]) -> int | None:
        """Bytes the config lets the store hold for pages, where it caps them; None: no cap
        the config gives."""
        return None

    @classmethod
    def ram_bytes(cls, extra: Mapping[str, Any]) -> int:
        """RAM a backend of this config takes on this node beyond the tiers, known before it
        starts (Mooncake's segment and buffer; a file backend's page cache is the kernel's
        to reclaim)."""
        return 0
