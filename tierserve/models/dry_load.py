"""A checkpoint checked against the model that would load it, without reading a weight:
`serve --dry-run` builds rank 0's model on the meta device, at the flags' tensor-parallel
sizes, and fills it from the safetensors headers through the loader's own `fill`. What a real
start refuses after its weights were read (a tensor missing or of another shape, an integer
tensor where a weight goes, heads or a vocabulary that do not split over the ranks, a config
the model's layers refuse) is refused here in a second. Values (a NaN weight) are not seen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from tierserve.layers import (
    TPGroup,
    attention_group,
    inverse_frequencies,
    set_tp_group,
    tp_group,
)
from tierserve.model_config import ModelConfig, read_hf_config, text_config
from tierserve.models.loader import (
    SCALE_SUFFIX,
    CheckpointLayout,
    fill,
    tensor_headers,
    weight_files,
)
from tierserve.models.quant_config import QuantConfig
from tierserve.models.quantization import SHAPE_SUFFIX, model_key, quantize_modules
from tierserve.models.registry import model_class


def check_checkpoint(path: str | Path, cfg: ModelConfig, tp_size: int, attention_size: int) -> None:
    """Raise TierserveError where loading `path` as `cfg` on rank 0 of `tp_size` ranks (their
    attention split over `attention_size`) would."""
    path = Path(path)
    # The rotary tables are not made on the meta device; their kind and factors are read here.
    inverse_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    outer = tp_group(), attention_group()
    set_tp_group(TPGroup(0, tp_size), TPGroup(0, attention_size))
    quant = QuantConfig.read(text_config(read_hf_config(path)))
    try:
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg)
            if quant is not None:  # refuses a row-parallel cut through a group
                quantize_modules(model, quant)
    finally:
        set_tp_group(*outer)
    targets = model.state_dict(keep_vars=True)
    if cfg.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    tensors = (
        (name, tensor)
        for name, tensor in header_tensors(path, CheckpointLayout.of(path, cfg.num_layers), quant)
        if not (cfg.tie_word_embeddings and name == "lm_head.weight")
    )
    fill(model, targets, tensors, f"checkpoint {path} does not match {cfg.architecture}")


def header_tensors(
    path: Path, layout: CheckpointLayout, quant: QuantConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, meta tensor) for every tensor the model uses, as the loader hands them to
    `fill`: a block-scaled fp8 weight as the float32 it is dequantized to; a quantized
    linear's tensors by their model names, its zero point unpacked to [rows, groups] (the rows
    its scale has), its weight_shape (a value, unseen here) left out."""
    files = [tensor_headers(file) for file in weight_files(path)]
    shapes = {key: h["shape"] for headers in files for key, h in headers.items()}
    for headers in files:
        for key in sorted(headers):
            name = layout.model_name(key)
            if name is None or (quant is not None and name.endswith(SHAPE_SUFFIX)):
                continue
            dtype, shape = _dtype(headers[key]["dtype"]), headers[key]["shape"]
            if key + SCALE_SUFFIX in headers:
                dtype = torch.float32
            if quant is not None and name.endswith(".weight_zero_point"):
                scale = shapes.get(key.removesuffix("zero_point") + "scale")
                shape = [scale[0] if scale else shape[0], shape[-1]]
            if quant is not None:
                name = model_key(name)
            yield name, torch.empty(shape, dtype=dtype, device="meta")


def _dtype(name: str) -> torch.dtype:
    """A safetensors dtype name as a torch dtype of its kind: what `fill` compares is whether
    it is a floating type, and its shape."""
    if name.startswith("F8"):
        return torch.float8_e4m3fn
    if name.startswith(("F", "BF")):
        return torch.float32
    return torch.int32
