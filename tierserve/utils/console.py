"""What the commands print: results that survive a closed pipe, and the version of every
`--json` output's schema (docs/plan.md lists the keys)."""

from __future__ import annotations

import os
import sys

JSON_SCHEMA_VERSION = 2


def emit(text: str) -> None:
    """Print a result; a reader that closed the pipe early (`| head`) is not an error, and the
    exit status still says what the command found."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
