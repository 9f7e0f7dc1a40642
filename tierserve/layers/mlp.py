"""The gated MLP (SwiGLU) of Llama's layers and DeepSeek's dense layers and shared experts:
gate and up packed column-parallel (one GEMM), down row-parallel, so a rank holds 1/tp of each.
With the CPU backend, a float32 or bf16 model's SiLU(gate) x up is tierserve's fused kernel
(layers/kernels/layer_ops.cpp), this module's torch code being its oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.layers.kernels import takes_rows
from tierserve.layers.parallel import PackedColumnLinear, RowParallelLinear, load_unpacked


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        parts = [("gate_proj", intermediate, 1), ("up_proj", intermediate, 1)]
        self.gate_up_proj = PackedColumnLinear(hidden, parts, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)
        load_unpacked(self)
        self.kernel = False  # set by the CPU attention backend (CPUPagedAttention.adopt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if self.kernel and takes_rows(gate, up, dims=(2,)):
            out = torch.empty_like(gate, memory_format=torch.contiguous_format)
            torch.ops.tierserve.silu_and_mul(gate, up, out)
            return self.down_proj(out)
        return self.down_proj(F.silu(gate).mul_(up))  # one temporary, not two
