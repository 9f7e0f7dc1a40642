"""Sizes with units: read what users type, format what we print.

Inside tierserve every size is an int of bytes. A bare number means decimal gigabytes (10^9 B),
because that is what SGLang's `--hicache-size 48` means and users copy numbers between the two;
binary units (GiB) must be written out.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, Overflow

from tierserve.errors import TierserveError

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

# Single letters (48G) are decimal like a bare number; only the "i" spellings are binary.
UNITS: dict[str, int] = {
    "b": 1,
    "k": KB,
    "kb": KB,
    "m": MB,
    "mb": MB,
    "g": GB,
    "gb": GB,
    "t": TB,
    "tb": TB,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_SIZE = re.compile(r"^(?P<number>\d*\.?\d+(?:e[+-]?\d+)?)\s*(?P<unit>[a-z]*)$", re.IGNORECASE)
MAX_SIZE = 10**18
_EXAMPLES = "e.g. 48GB, 48GiB, 0.5TB, 300 MB (a bare number is decimal GB)"


def parse_size(text: str | int | float, field: str = "size") -> int:
    """Bytes in `text`: "48GB", "48GiB", "0.5TB", "300 MB", or "48" (= 48 GB)."""
    raw = str(text).strip()
    if raw.startswith("-"):
        raise TierserveError(f"{field} must not be negative, got {text!r}", field=field)
    match = _SIZE.match(raw)
    if match is None:
        raise TierserveError(f"cannot read {field} {text!r}: {_EXAMPLES}", field=field)
    unit = match["unit"] or "GB"
    if unit.lower() not in UNITS:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise TierserveError(f"unknown unit {unit!r} in {field} {text!r}; use {known}", field=field)
    try:  # Decimal keeps 0.1 TB an exact 100,000,000,000 bytes
        size = int(Decimal(match["number"]) * UNITS[unit.lower()])
    except InvalidOperation as err:
        raise TierserveError(f"cannot read {field} {text!r}: {_EXAMPLES}", field=field) from err
    except (Overflow, OverflowError):  # past Decimal's exponents ("1e999999"): past 1 EB too
        size = MAX_SIZE + 1
    if size > MAX_SIZE:  # past any machine; also keeps every later float division finite
        raise TierserveError(f"{field} {text!r} is over 1 EB: {_EXAMPLES}", field=field)
    return size


def format_gb(n_bytes: float, digits: int = 1) -> str:
    """Decimal gigabytes, the unit SGLang's flags use: 17_374_000_000 -> '17.4 GB'."""
    return f"{n_bytes / GB:,.{digits}f} GB"


def format_gib(n_bytes: float, digits: int = 1) -> str:
    """Binary gibibytes, the unit vLLM's flags use: 2**30 -> '1.0 GiB'."""
    return f"{n_bytes / GiB:,.{digits}f} GiB"


def format_count(n: int) -> str:
    """Thousands separators for token and byte counts: 127000 -> '127,000'."""
    return f"{n:,}"


def format_bytes(n_bytes: int) -> str:
    """Exact bytes with separators, for per-token sizes: 70272 -> '70,272 B'."""
    return f"{n_bytes:,} B"
