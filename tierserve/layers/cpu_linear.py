"""Linear weights in oneDNN's blocked layout on CPU, as vLLM's CPU build keeps them.

torch's `F.linear` on CPU multiplies by the row-major weight and re-blocks it on every call; a
weight reordered once at load into oneDNN's own layout skips that. On the demo model's shapes
(2 threads) the gate/up GEMM of a 64-row decode step went from 0.49 to 0.27 ms and the LM head
from 2.1 to 1.3 ms (benchmarks/step_floor.py breaks a step down by op). The reordered weight
replaces the dense one, so no linear is held twice, except a head tied to the embedding: the
embedding's lookups need its rows, so the head gets its own reordered copy, which start-up
counts (`packed_head_bytes`).

Results equal F.linear's to float32 rounding, not bit for bit (another blocking of the same
sums), as vLLM's oneDNN GEMMs differ from torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN's CPU GEMMs take these weight dtypes; others (fp16, fp8) stay dense for F.linear.
_DTYPES = (torch.float32, torch.bfloat16)


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` gets reordered linear weights."""
    return device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, whichever layout `weight` is in."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module, kinds: tuple[type[nn.Linear], ...]) -> None:
    """Reorder the weight of every linear of `kinds` in `model` (loaded) for oneDNN, except
    those marked `keep_dense` (their weight is read as a tensor elsewhere: MLA's kv_b_proj)."""
    for module in model.modules():
        if not isinstance(module, kinds) or getattr(module, "keep_dense", False):
            continue
        weight = module.weight
        if weight.is_mkldnn or not packs_linears(weight.device, weight.dtype):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        module.weight = nn.Parameter(packed, requires_grad=False)


def packed_head_bytes(
    tied: bool, vocab: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> int:
    """Bytes beyond the checkpoint's on the node: a tied head's reordered copy of the
    embedding."""
    return vocab * hidden * dtype.itemsize if tied and packs_linears(device, dtype) else 0
