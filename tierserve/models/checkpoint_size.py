"""What a checkpoint's model will hold, read from its safetensors headers alone: parameters
(FLOPs count them) and bytes (start-up, `--dry-run` and the memory checks count them), a
quantized weight's as its backend keeps it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.model_config import read_hf_config, text_config
from tierserve.models.loader import CheckpointLayout, tensor_shapes, weight_files
from tierserve.models.quant_config import QuantConfig
from tierserve.models.quantization import quantized_size

# What data-parallel attention keeps once per attention group: the attention layers, the
# embedding and the LM head (the MLPs and experts are split over every rank).
_ATTENTION_SIDE = (".self_attn.", "embed_tokens.", "lm_head.")


def checkpoint_numel(path: str | Path, num_layers: int) -> int:
    """Parameters a model of `num_layers` will hold, read from the safetensors headers without
    loading them."""
    return checkpoint_numels(path, num_layers)[0]


def checkpoint_numels(path: str | Path, num_layers: int) -> tuple[int, int]:
    """(all parameters, those of the attention side) a model of `num_layers` will hold, in one
    read of the safetensors headers."""
    size = checkpoint_sizes(path, num_layers)
    return size.numel, size.attention_numel


@dataclass(frozen=True)
class CheckpointSize:
    """What a model of the checkpoint holds: parameters (a quantized weight's as many as its
    dense form, what FLOPs count) and bytes (at the model's dtype, a quantized weight's as its
    backend keeps it), all and those of the attention side."""

    numel: int
    attention_numel: int
    bytes: int
    attention_bytes: int


def checkpoint_sizes(
    path: str | Path,
    num_layers: int,
    itemsize: int = 4,
    device: torch.device | None = None,
    quantized_activations: str = "auto",
) -> CheckpointSize:
    """The checkpoint's `CheckpointSize` from its safetensors headers alone, for a model in a
    dtype of `itemsize` on `device` (CPU unless given)."""
    path = Path(path)
    quant = QuantConfig.read(text_config(read_hf_config(path)))
    layout = CheckpointLayout.of(path, num_layers)
    shapes = {k: s for file in weight_files(path) for k, s in tensor_shapes(file).items()}
    device = device or torch.device("cpu")
    numel = attention = held = attention_held = 0
    for key, shape in shapes.items():
        name = layout.model_name(key)
        if not name:
            continue
        sized = None
        if quant is not None:
            sized = quantized_size(
                key, name, shapes, quant, itemsize, device, quantized_activations
            )
        n, b = sized if sized is not None else (math.prod(shape), math.prod(shape) * itemsize)
        numel, held = numel + n, held + b
        if any(p in name for p in _ATTENTION_SIDE):
            attention, attention_held = attention + n, attention_held + b
    return CheckpointSize(numel, attention, held, attention_held)
