"""Rotary position embeddings, with the rope-scaling variants that Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from tierserve.errors import TierserveError
from tierserve.layers.kernels import takes_rows

if TYPE_CHECKING:
    from tierserve.model_config import ModelConfig


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    # YaRN: high frequencies (many rotations within the original context) kept, low ones divided
    # by `factor`, a linear ramp over the dimensions between beta_fast and beta_slow rotations.
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos/sin are multiplied by: YaRN's magnitude correction, 1 for every other kind."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    assert scaling is not None  # `kind` came from it
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise TierserveError(f"unsupported rope scaling type {kind!r}", field="rope_scaling")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position; applied in the half-rotation (NeoX) layout."""

    cos: torch.Tensor  # buffers: [max_positions, head_dim / 2]
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Set by the CPU attention backend (CPUPagedAttention.adopt): a float32 or bf16 q and k
        # are then rotated in place by tierserve's kernel, `_rotate` being its oracle.
        self.kernel = False
        if torch.get_default_device().type == "meta":
            # A shape-only construction (the loader rebuilds the tables for real): arithmetic
            # on meta tensors goes through torch's reference ops, whose first use imports
            # torch._dynamo, about a CPU-second in every engine process.
            shape = (max_positions, (head_dim + 1) // 2)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
            return
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        magnitude = attention_factor(scaling)
        self.register_buffer("cos", (angles.cos() * magnitude).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * magnitude).float(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rows(positions)
        if self.kernel and _kernel_takes(q, k, cos):
            torch.ops.tierserve.rotary_neox_(q, k, cos, sin)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [tokens, 1, head_dim/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as [tokens, head_dim] (each frequency twice, `cat(f, f)`), for layers
        that rotate in their own layout (MLA's interleaved pairs)."""
        cos, sin = self._rows(positions)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows at `positions`, gathered once per step: every layer shares this
        module and is passed the step's one positions tensor (held here, so its identity
        cannot be reused by another)."""
        if self._memo is None or self._memo[0] is not positions:
            self._memo = (positions, self.cos[positions], self.sin[positions])
        return self._memo[1], self._memo[2]


def rotary_for(cfg: ModelConfig) -> RotaryEmbedding:
    """The rotary tables a model of `cfg` uses, built in one place for the models and the
    loader (which rebuilds them after a meta-device construction)."""
    return RotaryEmbedding(
        cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    half = cos.shape[-1]
    return takes_rows(q, k, dims=(3,)) and q.shape[-1] == k.shape[-1] == 2 * half


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Both halves written into one output: the products and the concatenation as separate
    temporaries made a prefill step's rotary 4× slower than this."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty_like(xf)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)
