"""Linear weights in oneDNN's blocked layout on CPU, as vLLM's CPU build keeps them.

torch's `F.linear` on CPU multiplies by the row-major weight (float32: MKL's sgemm; bf16:
oneDNN, re-blocking the weight on every call); a weight reordered once at load into oneDNN's
own layout skips that. On the demo model's shapes (2 threads, an AMD EPYC) the gate/up GEMM of
a 64-row decode step went from 0.49 to 0.27 ms and the LM head from 2.1 to 1.3 ms
(benchmarks/step_floor.py breaks a step down by op). The reordered weight replaces the dense
one, so no linear is held twice, except a head tied to the embedding: the embedding's lookups
need its rows, so the head gets its own reordered copy, which start-up counts
(`packed_head_bytes`).

Results equal F.linear's to float32 rounding, not bit for bit (another blocking of the same
sums), as vLLM's oneDNN GEMMs differ from torch's.

Which dtypes are reordered depends on the CPU (benchmarks/cpu_linear_layout.py times both
layouts per shape and row count). MKL is Intel's: on an Intel Xeon (AMX, AVX-512) the dense
float32 weight took 0.24-0.62× the reordered one's time at 1 row and 0.39-0.65× at 8 (oneDNN's
call costs ~20 µs more; the LM head at 8 rows 1.07×), 0.71-1.03× at 64-512 rows; served
multi-turn ran ~10% faster with it, a one-row decode step took 2.5-3.1 ms against 3.6-4.1,
offline 64 × 128 and 64 streams were even. So float32 stays dense on an Intel CPU with MKL and
is reordered elsewhere (the EPYC figures above). bf16 is reordered wherever oneDNN has a bf16
GEMM (the Xeon: dense / reordered 0.97-1.67×, mostly 1.1-1.5×); on an AVX2-only CPU it has none
and bf16 linears stay dense.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.utils import cpu_field

INTEL = "GenuineIntel"


# oneDNN's primitive cache and ideep's each keep 1,024 GEMM primitives by default, one per row
# count and weight shape: the demo model's five linear shapes, met at 1,024 row counts, grew a
# process by 1.9 GB, which no plan counts; at 256 each, by 0.47 GB, and no further
# (benchmarks/primitive_cache.py). A serving engine meets a new row count with each prefill
# chunk and decode batch size; a mixed workload ran as fast either way.
PRIMITIVE_CACHE_CAPACITY = 256
PRIMITIVE_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_primitive_caches() -> None:
    """Bound oneDNN's and ideep's primitive caches, unless the user set them. Both read their
    variable at their first primitive (a weight's reorder, a GEMM): call before the first."""
    for name in PRIMITIVE_CACHE_VARS:
        os.environ.setdefault(name, str(PRIMITIVE_CACHE_CAPACITY))


def cpu_vendor() -> str:
    """This machine's CPU vendor as /proc/cpuinfo names it ("" where it does not say)."""
    return cpu_field("vendor_id")


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN's CPU GEMMs take on this CPU, where torch has oneDNN; others
    stay dense for F.linear. bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only
    CPU (AMD Zen 2/3, older Xeons) oneDNN refuses to reorder a bf16 weight, and F.linear
    computes it instead."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if onednn_has_bf16() else (torch.float32,)


def onednn_has_bf16() -> bool:
    """Whether torch's oneDNN has a bf16 GEMM on this CPU (torch's own check)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_dtypes(vendor: str) -> tuple[torch.dtype, ...]:
    """The weight dtypes whose linears are reordered on a CPU of `vendor`: oneDNN's, but for
    float32 where MKL's sgemm is native."""
    mkl_native = vendor == INTEL and torch.backends.mkl.is_available()
    return tuple(d for d in onednn_dtypes() if not (mkl_native and d == torch.float32))


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` gets reordered linear weights on this machine."""
    return device.type == "cpu" and dtype in packed_dtypes(cpu_vendor())


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, whichever layout `weight` is in (a quantized one is a callable
    that computes it: layers/quantized.py)."""
    if not isinstance(weight, torch.Tensor):
        y = weight(x)
        return y + bias if bias is not None else y
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linears(
    model: nn.Module,
    kinds: tuple[type[nn.Linear], ...],
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """Reorder the weight of every CPU linear of `kinds` in `model` (loaded) whose dtype is one
    of `dtypes` (this machine's `packed_dtypes` unless given) for oneDNN, except those marked
    `keep_dense` (their weight is read as a tensor elsewhere: MLA's kv_b_proj)."""
    dtypes = packed_dtypes(cpu_vendor()) if dtypes is None else dtypes
    for module in model.modules():
        if not isinstance(module, kinds) or getattr(module, "keep_dense", False):
            continue
        weight = module.weight
        if not isinstance(weight, torch.Tensor):  # quantized: its backend has its layout
            continue
        if weight.is_mkldnn or weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        module.weight = nn.Parameter(packed, requires_grad=False)


def packed_head_bytes(
    tied: bool, vocab: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> int:
    """Bytes beyond the checkpoint's on the node: a tied head's reordered copy of the
    embedding."""
    return vocab * hidden * dtype.itemsize if tied and packs_linears(device, dtype) else 0
