"""glibc's heap kept between steps on CPU.

A CPU step's activations are host allocations of a few MB each (a 2,048-token prefill of the
demo model: ~12 MB for the MLP's input). glibc serves a block above its mmap threshold (128 KB
at first, raised as such blocks are freed) with a fresh mapping, and trims the heap's free top
back to the system once it passes its trim threshold; either way the next step faults the same
memory in again, zeroed page by page. On this 2-core CPU the first burst's prefill steps ran
~1.6× their later time from it, and every run paid some of it. vLLM's CPU build asks for
tcmalloc (LD_PRELOAD) for the same reason; tierserve sets glibc's two thresholds instead, with
no library to install: blocks up to 32 MB come from the heap, and freed heap stays with the
process. The process's resident memory then stays at its peak, the activations the plan
counts, rather than dropping between steps.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger("tierserve")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2); a bigger block is
# still mapped, and unmapped when freed.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: freed heap is kept up to 2 GB


def keep_freed_heap() -> bool:
    """Set glibc's thresholds in this process; False where the C library is not glibc (musl,
    macOS), which is then left as it is."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        logger.warning("glibc refused its malloc thresholds: freed activations are unmapped")
    return done
