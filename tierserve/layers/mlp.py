"""The gated MLP (SwiGLU) of Llama's layers and DeepSeek's dense layers and shared experts:
gate and up packed column-parallel (one GEMM), down row-parallel, so a rank holds 1/tp of each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.layers.parallel import PackedColumnLinear, RowParallelLinear, load_unpacked


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        parts = [("gate_proj", intermediate, 1), ("up_proj", intermediate, 1)]
        self.gate_up_proj = PackedColumnLinear(hidden, parts, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)
        load_unpacked(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate).mul_(up))  # one temporary, not two
