"""What /proc/cpuinfo says of this machine's CPU, read once: the kernels' build cache, the
linears' layout and the benchmark reports all ask it, and must see the same CPU."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _first_cpu() -> dict[str, str]:
    """The first processor's fields ({} where there is no /proc/cpuinfo: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its blank line
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_field(name: str) -> str:
    """One field of the first processor ("vendor_id", "model name"...), "" where it is absent."""
    return _first_cpu().get(name, "")


def cpu_flags() -> tuple[str, ...]:
    """The instruction-set flags the kernel reports (avx512f, amx_bf16...), in its order."""
    return tuple(cpu_field("flags").split())
