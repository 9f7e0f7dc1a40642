"""Directories the user names (a storage path, a hidden-states directory): whether this process
could make and write one, told without making anything, so that `serve --dry-run` refuses what
a real start would."""

from __future__ import annotations

import os
from pathlib import Path


def unusable_dir(path: Path) -> str | None:
    """Why `path` cannot be a directory this process writes, or None: the path, or the nearest
    folder above it that exists, must be a directory it may write and enter."""
    there = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not there.is_dir():
        return f"{there} is not a directory"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{there} is not writable"
    return None
