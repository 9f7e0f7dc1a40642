"""RMSNorm, computed in float32 as the reference implementations do; with the CPU backend, a
float32 or bf16 model's runs tierserve's fused kernel (layers/kernels/layer_ops.cpp), this
module's torch code being its oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierserve.layers.kernels import takes_rows


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = False  # set by the CPU attention backend (CPUPagedAttention.adopt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and _kernel_takes(x, self.weight):
            # empty_like: a third of torch.empty(shape, dtype=...)'s 6 µs here, twice a layer
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            torch.ops.tierserve.rms_norm(x, self.weight, self.eps, out)
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op instead of six: a decode step runs 2 per layer, each a few small tensors.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype  # transformers' order: normalise in float32, round, then the weight
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return takes_rows(x, dims=(2, 3)) and weight.dtype == x.dtype
