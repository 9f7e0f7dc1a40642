"""The attention backends by name (`--attention-backend`), and what `auto` picks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierserve.cache import PagedKV
from tierserve.layers import kernels
from tierserve.layers.attention import AttentionBackend, TorchAttention
from tierserve.layers.paged_attention import CPUPagedAttention

ATTENTION_BACKENDS: dict[str, Callable[[PagedKV, int], AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu": CPUPagedAttention,
}


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto`: the CPU kernel on CPU when it is built for this machine (make builds it), else
    torch; any other name as given."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" and kernels.load(build_if_missing=False) else "torch"
