"""A CPU engine keeps glibc's freed heap (engine/host_heap.py): a step-sized block comes from
the heap rather than a fresh mapping, and freeing it leaves it with the process, where a plain
process maps and unmaps it. Each case is a fresh process, so that nothing earlier has moved
glibc's own (dynamic) thresholds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierserve.args import default_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

PROBE = """
import ctypes, json, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "engine":
    from tierserve import LLM
    llm = LLM(sys.argv[2], max_total_tokens=1024)
block = 20 << 20  # a 2,048-token prefill's larger activations: ~12 MB on the demo model
before = libc.mallinfo2()
p = libc.malloc(block)
ctypes.memset(p, 1, block)
held = libc.mallinfo2()
libc.free(p)
after = libc.mallinfo2()
print(json.dumps({"mapped": held.hblkhd - before.hblkhd, "kept": after.fordblks}))
"""


def _probe(case: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, case, default_model()],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpu_engine_keeps_freed_activations_where_a_plain_process_unmaps_them():
    block = 20 << 20
    plain, engine = _probe("plain"), _probe("engine")
    assert plain["mapped"] >= block and plain["kept"] < block
    assert engine["mapped"] == 0 and engine["kept"] >= block
