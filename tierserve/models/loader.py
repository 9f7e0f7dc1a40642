"""Builds a model from a local Hugging Face directory: config.json + one or sharded safetensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from tierserve.config import ModelConfig
from tierserve.errors import TierserveError
from tierserve.models.registry import model_class


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise TierserveError(f"no model.safetensors (or index) in {path}", field="model")


def checkpoint_numel(path: str | Path) -> int:
    """Parameters in the checkpoint, read from the safetensors headers without loading them."""
    total = 0
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                total += math.prod(f.get_slice(key).get_shape())
    return total


def load_model(
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    path = Path(path)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model = model.to_empty(device=device).to(dtype)
    state = {}
    for file in weight_files(path):
        state.update(load_file(str(file), device=str(device)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if not u.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise TierserveError(
            f"checkpoint {path} does not match {cfg.architecture}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}",
            field="model",
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_buffers(model, cfg, device)
    return model.eval()


def _rebuild_buffers(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    # Buffers made on the meta device hold no values: recompute the rotary tables for real.
    from tierserve.layers.rotary import RotaryEmbedding

    fresh = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    rotary = model.model.rotary
    rotary.cos, rotary.sin = fresh.cos, fresh.sin
