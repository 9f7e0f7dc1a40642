"""`file`: page objects as files in a local directory that every server on the node may share.

Layout: `<dir>/<key[:2]>/<key>`, and the directory's record `<dir>/.usage`: its cap and the
bytes its objects hold. A write goes to a temporary file in `<dir>/.tmp` first and is renamed
into place (atomic on one filesystem), so a reader never sees half an object and concurrent
writers of the same key both succeed.

The cap is the directory's, whatever the number of processes sharing it (the ranks of a TP
server, several servers): every process moves objects in and out under an exclusive `flock` of
the record and counts them in it, so once writes have landed the directory's files (objects and
record) hold at most `max_bytes`. Past the cap the least recently used objects go (a read
refreshes an object's mtime), down to 90% of it; an eviction counts the directory afresh, so
whatever drifted (a process killed between its rename and its count) is put right there.
Without `max_bytes` a process takes the cap the directory's record holds, which the first
process to open the directory set to the smaller of 64 GB and half of the space its filesystem
had for it (free space plus what the directory already held): every process agrees on it, and N
of them cannot each take half the disk. A process given `max_bytes` sets the directory's cap for
every process (the last one started wins): servers sharing a directory should give the same.

A directory removed while serving is made again by the next call, with one warning; one that
cannot be (its path is a file now, no permission) fails every call, so the circuit breaker opens.
The directory outlives the server: a restarted server finds its pages again. A local filesystem
only: `flock` does not lock across NFS clients.

extra config: `path` (default `$XDG_CACHE_HOME/tierserve/kv` or `~/.cache/tierserve/kv`),
`max_bytes` (bytes, or a size such as "200GB").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError
from tierserve.storage.backend import EXTRA_FIELD, StorageBackend, config_bytes
from tierserve.utils import unusable_dir

logger = logging.getLogger("tierserve")

DEFAULT_CAP = 64 * 10**9
RECORD = ".usage"
RECORD_BYTES = 64  # the record is padded to this, and counted in the cap
STALE_TMP_S = 3600.0  # a temporary file this old was left by a writer that died


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tierserve" / "kv"


class FileBackend(StorageBackend):
    name = "file"
    config_keys = frozenset({"path", "max_bytes"})

    def __init__(self, extra: Mapping[str, Any]) -> None:
        self.root = self._root(extra)
        self.tmp = self.root / ".tmp"
        given = extra.get("max_bytes")
        self._given = None if given is None else config_bytes(extra, "max_bytes", 0)
        self.evicted = 0  # objects this process deleted (every server's, least recent first)
        self._opened = False
        try:
            self._ensure_dirs()
            self._drop_stale_tmp()
            with self._locked() as record:
                if self._given is not None:
                    record["cap"] = self._given  # the directory's cap, for every process
                self._note(record)
        except OSError as err:  # the user's path: not a directory, not writable, under /proc
            said = f"the storage path {self.root} cannot be used: {err.strerror}"
            raise TierserveError(said if err.strerror else str(err), EXTRA_FIELD) from None
        self._opened = True

    @staticmethod
    def _root(extra: Mapping[str, Any]) -> Path:
        path = extra.get("path")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            message = "path in the storage config must be a directory's path (a string)"
            raise TierserveError(message, EXTRA_FIELD)
        return Path(path or default_dir()).expanduser()

    @classmethod
    def check_config(cls, extra: Mapping[str, Any]) -> None:
        cls._root(extra)
        config_bytes(extra, "max_bytes", 0)

    @classmethod
    def page_room(cls, extra: Mapping[str, Any]) -> int | None:
        if extra.get("max_bytes") is None:
            return None
        return config_bytes(extra, "max_bytes", 0) - RECORD_BYTES

    @classmethod
    def preflight(cls, extra: Mapping[str, Any]) -> None:
        """The directory, or the nearest folder above it that exists, must be a directory this
        process may write (nothing is made: a dry run leaves no trace)."""
        cls.check_config(extra)
        root = cls._root(extra)
        if why := unusable_dir(root):
            raise TierserveError(f"the storage path {root} cannot be used: {why}", EXTRA_FIELD)

    # --- the directory and its record ------------------------------------------------------

    def _ensure_dirs(self) -> None:
        """Make the directory again if it vanished (one warning); raise if it cannot be."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"the storage path {self.root} is not a directory")
        if st is not None and self.tmp.is_dir():
            return
        if self._opened:  # it was there, and is gone
            what = "lost its .tmp" if st is not None else "vanished"
            logger.warning("storage directory %s %s while serving: made again", self.root, what)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def _drop_stale_tmp(self) -> None:
        """Temporary files of writers that died outlive them and are in no count."""
        now = time.time()
        for entry in os.scandir(self.tmp):
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        """The directory's record, read and written back under an exclusive flock: every
        process's writes and evictions are counted in it one after another."""
        path = self.root / RECORD
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the directory was removed and made again meanwhile: lock the new one
        try:
            record = self._read(fd)
            yield record
            text = json.dumps(record, separators=(",", ":")).encode().ljust(RECORD_BYTES)
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        finally:
            os.close(fd)  # releases the lock

    def _read(self, fd: int) -> dict[str, int]:
        try:
            record = json.loads(os.pread(fd, RECORD_BYTES * 4, 0) or b"{}")
        except ValueError:  # a writer killed mid-write: counted again below
            record = {}
        if not isinstance(record, dict):
            record = {}
        # A value no process wrote (a negative count stopped eviction for good): read again.
        if not _count(record.get("used")):
            record["used"] = self._scan_bytes()
        if not _count(record.get("cap")):
            record["cap"] = self._given if self._given is not None else self._default_cap(record)
        return record

    def _default_cap(self, record: dict[str, int]) -> int:
        """Half the space the filesystem has for this directory: what is free plus what the
        directory holds (so a restart over a full directory does not halve it again)."""
        free = shutil.disk_usage(self.root).free
        return min(DEFAULT_CAP, (free + record["used"]) // 2)

    def _note(self, record: dict[str, int]) -> None:
        self.max_bytes, self.used = record["cap"], record["used"]

    # --- reads -----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def exists(self, keys: list[str]) -> list[bool]:
        self._ensure_dirs()
        return [self._path(k).exists() for k in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        self._ensure_dirs()
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

    # --- writes ----------------------------------------------------------------------------

    def put(self, items: Mapping[str, bytes]) -> list[str]:
        self._ensure_dirs()
        staged = [(key, self._stage(key, blob), len(blob)) for key, blob in items.items()]
        try:
            with self._locked() as record:
                dropped = self._place(record, staged)
                self._note(record)
            return dropped
        finally:
            for _, tmp, _ in staged:  # those not placed (no room, or an error)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _stage(self, key: str, blob: bytes) -> str:
        """The object in a temporary file, written outside the lock (the slow part)."""
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=key[:8])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
        except OSError:  # a full disk: leave no temporary file behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _place(self, record: dict[str, int], staged: list[tuple[str, str, int]]) -> list[str]:
        """Rename the staged objects into place, evicting first when they would not fit; the
        keys of those that did not fit even then. The count goes up before the renames: a
        process killed between them over-counts, which the next eviction's scan puts right,
        and never lets the directory outgrow its cap."""
        room = record["cap"] - RECORD_BYTES
        incoming = sum(n for _, _, n in staged)
        if record["used"] + incoming > room:
            record["used"] = self._evict(max(0, int(room * 0.9) - incoming))
        dropped = []
        for key, tmp, n in staged:
            path = self._path(key)
            old = _size(path)
            if record["used"] - old + n > room:
                dropped.append(key)  # larger than what eviction left, like a full queue's
                continue
            record["used"] += n - old
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        return dropped

    def _objects(self) -> list[tuple[float, int, str]]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for sub in os.scandir(self.root):
                if sub.name.startswith(".") or not sub.is_dir():
                    continue
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    for entry in os.scandir(sub.path):
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat()
                            out.append((st.st_mtime, st.st_size, entry.path))
        return out

    def _scan_bytes(self) -> int:
        return sum(size for _, size, _ in self._objects())

    def _evict(self, target: int) -> int:
        """Delete least recently used objects (every server's) until the directory's objects
        hold at most `target` bytes; the bytes they hold then, counted afresh."""
        objects = sorted(self._objects())
        used = sum(size for _, size, _ in objects)
        for _, size, path in objects:
            if used <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                self.evicted += 1
            used -= size
        return used


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
