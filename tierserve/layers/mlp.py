"""The gated MLP (SwiGLU) of Llama's layers and DeepSeek's dense layers and shared experts:
gate and up column-parallel, down row-parallel, so a rank holds 1/tp of each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.layers.parallel import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias=False)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
