"""Input files of one JSON value a line (`tierserve batch` and `--regenerate`): each line read
on its own, so that a bad one is reported as `FILE:N`, whatever is wrong with it (not UTF-8,
not JSON), before anything is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError


def read_json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """(`FILE:N`, value) for every line that is not blank."""
    if not path.exists():
        raise TierserveError(f"input file not found: {path}", field="input")
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            message = f"{where}: not UTF-8 text (byte {err.start + 1} of the line)"
            raise TierserveError(message, "input") from None
        if not text.strip():
            continue
        try:
            yield where, json.loads(text, parse_constant=_not_json)
        except json.JSONDecodeError as err:
            raise TierserveError(f"{where}: not JSON ({err.msg})", "input") from None
        except ValueError as err:  # NaN or Infinity: a request body cannot carry them
            raise TierserveError(f"{where}: not JSON ({err})", "input") from None


def _not_json(name: str) -> Any:
    """Python's json reads NaN and Infinity, which JSON has not: the run died later, when a
    request with one was encoded."""
    raise ValueError(f"{name} is no JSON number")
