"""KVSpec: what one token's KV looks like on one rank, derived once from the model config.

Every fact about KV sizes comes from here: the pools allocate `spec.page_shape` blocks, the
start-up table prints `spec.bytes_per_token`, and `tierserve plan` sizes tiers with the same
object. Nothing else multiplies layers by heads by bytes.

Two kinds:
- `kv`: per-head K and V (MHA, GQA, MQA). A rank stores `max(1, ceil(kv_heads / tp))` heads, so
  when tp > kv_heads each head is replicated on tp / kv_heads ranks.
- `latent`: one compressed vector per token and layer (MLA: kv_lora_rank + qk_rope_head_dim
  values), the same on every rank: TP cannot split it.

A page holds `page_size` tokens of every layer as one contiguous block of
`[layers, parts, heads, page_size, dim]` elements (parts = 2 for K and V, 1 for a latent); see
`cache/pool.py` for the buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from tierserve.errors import TierserveError
from tierserve.utils import DTYPES, canonical, float8_of, torch_dtype

if TYPE_CHECKING:
    import torch

    from tierserve.model_config import ModelConfig


def kv_dtype_name(name: str) -> str:
    """The canonical name of a KV dtype, or a user error listing the known ones."""
    return canonical(name, field="kv_dtype", what="KV dtype")


@dataclass(frozen=True)
class KVSpec:
    kind: Literal["kv", "latent"]
    num_layers: int
    heads: int  # heads this rank stores (1 for a latent)
    dim: int  # head_dim for K/V; kv_lora_rank + qk_rope_head_dim for a latent
    dtype: str  # canonical storage dtype (dtypes.DTYPES)
    page_size: int
    model_heads: int = 1  # the model's KV heads (one copy), for totals and replication
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "heads", "dim", "page_size", "model_heads", "tp"):
            if getattr(self, name) <= 0:
                raise TierserveError(f"{name} must be > 0, got {getattr(self, name)}", "model")
        kv_dtype_name(self.dtype)

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: str, page_size: int = 1, tp: int = 1) -> KVSpec:
        dtype = kv_dtype_name(dtype)
        if cfg.kv_lora_rank:
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            return cls("latent", cfg.num_layers, 1, width, dtype, page_size, 1, tp)
        heads = max(1, math.ceil(cfg.num_kv_heads / tp))
        return cls(
            "kv", cfg.num_layers, heads, cfg.head_dim, dtype, page_size, cfg.num_kv_heads, tp
        )

    # --- sizes ----------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        """K and V, or the one latent."""
        return 2 if self.kind == "kv" else 1

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype].bytes

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One page as one contiguous block: [layers, parts, heads, page_size, dim]."""
        return (self.num_layers, self.parts, self.heads, self.page_size, self.dim)

    @property
    def bytes_per_token(self) -> int:
        """What this rank's pools hold for one token (all layers)."""
        return self.num_layers * self.parts * self.heads * self.dim * self.dtype_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def total_bytes_per_token(self) -> int:
        """One copy of the whole model's KV for one token (all ranks' distinct bytes)."""
        return self.bytes_per_token // self.heads * self.model_heads

    @property
    def copies(self) -> int:
        """How many ranks hold each byte: tp for a latent, tp / kv_heads for replicated heads."""
        if self.kind == "latent":
            return self.tp
        return max(1, self.tp // self.model_heads)

    @property
    def replicated(self) -> bool:
        return self.copies > 1

    def host_sharing(self, local_ranks: int) -> int:
        """Local ranks that hold each host byte identically and can share one copy of it: the
        ranks of a replica group that live on one node (neighbouring ranks hold the same KV
        head; a latent is the same on all). 1: every rank's host tier is its own."""
        copies = min(self.copies, local_ranks)
        return copies if copies > 1 and local_ranks % copies == 0 else 1

    def share_group(self, rank: int, local_ranks: int) -> tuple[int, int]:
        """(group, first rank) of the ranks sharing `rank`'s host copy on its node; the first
        rank writes the copy, the others read it."""
        sharing = self.host_sharing(local_ranks)
        return rank // sharing, rank // sharing * sharing

    def torch_dtype(self) -> torch.dtype:
        """The element type pools store (fp8 as bytes: dtypes.torch_dtype)."""
        return torch_dtype(self.dtype)

    def float8(self) -> torch.dtype | None:
        """The float8 type whose bytes the pools hold, for fp8 KV; None otherwise."""
        return float8_of(self.dtype)


def short_kv_dtype(text: str) -> str:
    """The planner's short name for any spelling users bring (tierserve's, SGLang's, vLLM's:
    sizing/kv.py knows them all); "" for auto (the model's dtype)."""
    if text.lower() == "auto":
        return ""
    return DTYPES[kv_dtype_name(text.lower())].short


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens (the last one partly filled)."""
    return -(-num_tokens // page_size)


class KVBytes(NamedTuple):
    total: int  # one copy of the whole model's KV for one token
    per_rank: int  # what one rank's pool allocates for one token
    replicated: bool  # some ranks hold identical copies of the same KV


def kv_spec(model: ModelConfig, kv_dtype: str, tp: int = 1, page_size: int = 1) -> KVSpec:
    return KVSpec.from_model(model, kv_dtype, page_size, tp)


def kv_bytes(spec: KVSpec) -> KVBytes:
    return KVBytes(spec.total_bytes_per_token, spec.bytes_per_token, spec.replicated)


def override_per_rank(kv: KVBytes, per_rank: int) -> KVBytes:
    """Use a measured per-rank size (e.g. from a server log) and scale the total alike."""
    if per_rank <= 0:
        message = f"kv bytes per token must be > 0, got {per_rank}"
        raise TierserveError(message, field="kv_bytes_per_token")
    return KVBytes(per_rank * kv.total // kv.per_rank, per_rank, kv.replicated)
