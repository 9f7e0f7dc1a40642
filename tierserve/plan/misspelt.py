"""Another server's command line, as the plan reads it: the flags that do not size memory are
that server's to check, but one a letter or two from a flag that does (`--hicache-sise`) was
planned as if absent, and the line said it fit."""

from __future__ import annotations

import argparse
import difflib

from tierserve.errors import TierserveError


def refuse_misspelt(
    parser: argparse.ArgumentParser, ignored: list[str], server: str, field: str
) -> None:
    """Raise for the first word of `ignored` that is close to one of `parser`'s flags."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for word in ignored:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85)
        if flag.startswith("--") and close:
            raise TierserveError(f"{server} has no {flag}: did you mean {close[0]}?", field=field)
