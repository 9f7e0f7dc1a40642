"""A batch run's output file: the lines already written (a rerun resumes from them), the failed
ones dropped for their retries, and the checks and lock taken before a run writes it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tierserve.errors import TierserveError


def read_output(path: Path) -> dict[str, bool]:
    """custom_id → whether it succeeded, for the lines already written. A torn last line (the
    run was killed mid-write) is cut off; any other line that is not an output record stops the
    run with its line number, before anything is sent."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    done = {}
    for number, raw in enumerate(data[:keep].splitlines(), 1):
        if raw.strip():
            custom_id, ok = _parse_record(raw, f"{path}:{number}")
            done[custom_id] = ok
    return done


def _parse_record(raw: bytes, where: str) -> tuple[str, bool]:
    try:
        record = json.loads(raw)
        custom_id = record["custom_id"]
        if not isinstance(custom_id, str):
            raise TypeError(custom_id)
        return custom_id, record["response"]["status_code"] == 200
    except (ValueError, KeyError, TypeError):
        message = f"{where}: not a batch output line; fix or remove it, then rerun"
        raise TierserveError(message, "output") from None


def drop_failed(path: Path) -> None:
    """Rewrite the output without its failed lines, so that their retries replace them; the
    new file takes the old one's place atomically."""
    kept = [
        raw
        for raw in path.read_bytes().splitlines(keepends=True)
        if raw.strip() and _parse_record(raw, str(path))[1]
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)


def check_output(out: Path) -> None:
    """A run reads its output whole to resume, and rewrites it: one that is not a regular
    file (/dev/zero: read forever, at ~600 MB/s of memory) is refused before anything, its
    lock beside it included. One that does not exist yet is made."""
    if out.exists() and not out.is_file():
        message = (
            f"--output {out} is not a regular file: a run reads its output to resume and "
            "rewrites it; give a file's path"
        )
        raise TierserveError(message, "output")


def writable_output(out: Path) -> Path:
    """`out`, once it opens for appending: refused before any request is sent, not after the
    first answer, whose work would be lost."""
    try:
        with out.open("a"):
            pass
    except OSError as err:
        raise TierserveError(f"cannot write --output {out}: {err.strerror}", "output") from None
    return out


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """One run at a time per output file, held beside it in `OUT.lock` (the file itself is
    rewritten to drop failed lines): two runs on one output lost rows, or wrote them twice.
    The run removes its lock file as it ends, while it still holds it."""
    lock_path = out.with_name(out.name + ".lock")
    fd = _held_lock(out, lock_path)
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        os.close(fd)


def _held_lock(out: Path, lock_path: Path) -> int:
    """A descriptor of `lock_path`, flocked. A run that opened the file just before its holder
    removed it would lock a file no one else can see: it opens the path again."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            message = f"cannot write --output {out}: {err.strerror}"
            raise TierserveError(message, "output") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            message = f"--output {out} is being written by another run (it holds {lock_path})"
            raise TierserveError(message, "output") from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
