"""`file`: page objects as files in a local directory that every server on the node may share.

Layout: `<dir>/<key[:2]>/<key>`. A write goes to a temporary file first and is renamed into
place (atomic on one filesystem), so a reader never sees half an object and concurrent writers
of the same key both succeed. The directory is capped (`max_bytes`, default: the smaller of
64 GB and half the filesystem's free space at start-up); past the cap the least recently used
objects go (a read refreshes an object's mtime), down to 90% of it. The directory outlives the
server: a restarted server finds its pages again.

extra config: `path` (default `$XDG_CACHE_HOME/tierserve/kv` or `~/.cache/tierserve/kv`),
`max_bytes` (bytes, or a size such as "200GB").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierserve.storage.backend import StorageBackend, config_bytes

DEFAULT_CAP = 64 * 10**9


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tierserve" / "kv"


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, extra: Mapping[str, Any]) -> None:
        self.root = Path(extra.get("path") or default_dir()).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = self.root / ".tmp"
        self.tmp.mkdir(exist_ok=True)
        free = shutil.disk_usage(self.root).free
        self.max_bytes = config_bytes(extra, "max_bytes", min(DEFAULT_CAP, free // 2))
        self.used = sum(size for _, size, _ in self._objects())
        self.evicted = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def exists(self, keys: list[str]) -> list[bool]:
        return [self._path(k).exists() for k in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                out.append(path.read_bytes())
            except FileNotFoundError:  # never written, or evicted by another server meanwhile
                out.append(None)
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's file
                os.utime(path)  # recently used: evicted last
        return out

    def put(self, items: Mapping[str, bytes]) -> None:
        for key, blob in items.items():
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=key[:8])
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except OSError:  # a full disk: leave no temporary file behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self.used += len(blob)
        if self.used > self.max_bytes:
            self._evict(int(self.max_bytes * 0.9))

    def _objects(self) -> list[tuple[float, int, Path]]:
        out = []
        for sub in self.root.iterdir():
            if sub.name == ".tmp" or not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                with contextlib.suppress(FileNotFoundError):  # another server's eviction
                    st = entry.stat()
                    out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _evict(self, target: int) -> None:
        """Delete least recently used objects (every server's) until the directory is under
        `target` bytes."""
        objects = sorted(self._objects())
        self.used = sum(size for _, size, _ in objects)
        for _, size, path in objects:
            if self.used <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                self.evicted += 1
            self.used -= size
