"""The attention backends by name (`--attention-backend`), and what `auto` picks."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tierserve.cache import PagedKV
from tierserve.errors import TierserveError
from tierserve.layers import kernels
from tierserve.layers.attention import AttentionBackend, TorchAttention
from tierserve.layers.paged_attention import CPUPagedAttention

logger = logging.getLogger("tierserve")

ATTENTION_BACKENDS: dict[str, Callable[[PagedKV, int], AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu": CPUPagedAttention,
}


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto`: the CPU kernel on CPU when it is built for this machine (make builds it), else
    torch; any other name as given. Decided at start-up, before weights or pools: `cpu` on
    another device is refused, and `cpu` asked for by name is built now if it is not yet
    (a missing compiler is refused here, not after the model has loaded)."""
    if name == "auto":
        if device.type != "cpu":
            return "torch"
        if kernels.load(build_if_missing=False):
            return "cpu"
        # A source edited or torch upgraded since the last build changes the build's key: say
        # so, rather than serve at the torch backend's speed without a word.
        logger.warning(
            "attention backend: torch, since tierserve's CPU kernels are not built for this "
            "machine and torch (no %s); a batch-64 decode step of the demo model takes 1.6x "
            "as long without them. `python -m tierserve.layers.kernels` builds them (make "
            "does), or `--attention-backend cpu` builds them at start-up",
            kernels.build_dir() / kernels.LIBRARY,
        )
        return "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise TierserveError(
                f"--attention-backend cpu runs on CPU, not {device.type}; use torch",
                field="attention_backend",
            )
        kernels.load(build_if_missing=True)
    return name
