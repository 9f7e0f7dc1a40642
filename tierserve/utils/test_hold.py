"""The test-only holds that order a step, a grammar compile or a schema check from outside: a
test creates a file; the process that meets the hold writes a marker and waits until the test
removes the file. Nothing happens where the test's variable is unset."""

from __future__ import annotations

import os
import time
from pathlib import Path


def wait_while_held(hold: str | Path | None, marker: str | Path) -> None:
    """While the file `hold` exists: write `marker` (the test's sign that this waits), then
    wait until the file is gone."""
    if not hold or not os.path.exists(hold):
        return
    Path(marker).touch()
    while os.path.exists(hold):
        time.sleep(0.01)
