"""tierserve's CPU kernels: C++ sources built once for this machine and torch, then loaded as
torch ops (`torch.ops.tierserve.*`).

Built ahead of time by `make` (`python -m tierserve.layers.kernels`), or on first use by a
backend asked for by name; never at a plain start. The build is one g++ call against torch's
headers and libraries (no Python extension module, no ninja), kept in
`$XDG_CACHE_HOME/tierserve/kernels/KEY/` where KEY hashes the sources, the flags, torch's
version and the CPU's instruction-set flags (the code is compiled with -march=native), so a
changed source, torch or CPU builds anew and never loads a stale library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from tierserve.errors import TierserveError
from tierserve.utils import cpu_field

logger = logging.getLogger("tierserve")

# What the kernels' model-dtype rows may hold (RMSNorm, rotary, paged attention's queries and
# output): a float32 or a bf16 model's.
ROW_DTYPES = (torch.float32, torch.bfloat16)


def takes_rows(*rows: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether the kernels take `rows` as they are: CPU tensors of one dtype of ROW_DTYPES, of
    `dims` dimensions, their last contiguous (the rest may be strided views)."""
    # A loop, not all() over a generator, and is_cpu, not device.type: each layer asks
    # several times a step, and those cost 2-3 µs a call here.
    dtype = rows[0].dtype
    if dtype not in ROW_DTYPES:
        return False
    for x in rows:
        if x.dtype != dtype or not x.is_cpu or x.dim() not in dims or x.stride(-1) != 1:
            return False
    return True


SOURCES = tuple(Path(__file__).with_name(n) for n in ("paged_attention.cpp", "layer_ops.cpp"))
# Every header beside the sources: each is part of the build's key, so a changed one rebuilds.
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# Fast math without -ffinite-math-only: masked scores are -inf and must stay so.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
LIBRARY = "tierserve_kernels.so"
_loaded = False


def build_dir() -> Path:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    isa = cpu_field("flags") or platform.processor()
    h.update(" ".join(FLAGS).encode() + torch.__version__.encode() + isa.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tierserve" / "kernels" / h.hexdigest()[:16]


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build() -> Path:
    """Compile the kernels for this machine (12-15 s on two cores here); the library's path."""
    out = build_dir() / LIBRARY
    if out.exists():
        return out
    cxx = compiler()
    if cxx is None:
        raise TierserveError(
            "the CPU kernels need a C++ compiler (apt-get install g++), or use "
            "--attention-backend torch",
            field="attention_backend",
        )
    from torch.utils import cpp_extension

    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch.compiled_with_cxx11_abi())
    lib_dirs = cpp_extension.library_paths()
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *map(str, SOURCES)]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs]
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    cmd += ["-lc10", "-ltorch_cpu", "-o", str(partial)]
    logger.info("building tierserve's CPU kernels in %s (once per machine and torch)", out.parent)
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise TierserveError(
            f"building the CPU kernels failed ({cxx}): {done.stderr.strip()[-1500:]}",
            field="attention_backend",
        )
    partial.rename(out)  # atomic: a concurrent loader sees no library or a whole one
    logger.info("built the CPU kernels in %.0f s", time.monotonic() - start)
    return out


def load(build_if_missing: bool) -> bool:
    """Load the kernels into torch.ops.tierserve; False when they are not built and
    `build_if_missing` is off (a build that fails raises TierserveError)."""
    global _loaded
    if _loaded:
        return True
    path = build_dir() / LIBRARY
    if not path.exists():
        if not build_if_missing:
            return False
        path = build()
    torch.ops.load_library(str(path))
    _loaded = True
    return True
