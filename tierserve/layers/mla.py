"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi-K2): its projections, the latent a
KV pool stores, and the two ways to attend over it.

Per token, a layer keeps one latent: `kv_lora_rank` values (the normalised compressed KV) and
`qk_rope_head_dim` values (the rotated key part every head shares). Keys and values per head
are that latent up-projected by `kv_b_proj`. Two equal ways to attend:
- expanded (prefill): up-project the context's latents to per-head keys and values, then plain
  attention; cheap when many queries share the context;
- absorbed (decode, as SGLang and vLLM do): fold `kv_b_proj`'s key half into the query and its
  value half into the output, so scores and the weighted sum run in the latent space and cached
  latents are never up-projected.
Parameter names are transformers'; rotary cos/sin come from the caller (interleaved pairs when
`interleave`, DeepSeek's layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.layers.forward_batch import causal_mask
from tierserve.layers.norm import RMSNorm
from tierserve.layers.parallel import (
    ColumnParallelLinear,
    PackedColumnLinear,
    RowParallelLinear,
    load_unpacked,
    shard_size,
    tp_group,
)
from tierserve.layers.rotary import yarn_mscale


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float  # softmax scale: qk_head_dim ** -0.5, times yarn's mscale² when scaled
    rms_norm_eps: float = 1e-6
    interleave: bool = True


def softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale² when the rope is scaled with mscale_all_dim
    (DeepSeek-V3 and Kimi-K2 scale attention this way, beside scaling cos/sin)."""
    scale = qk_head_dim**-0.5
    rope = rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, dim] with cos/sin [tokens, dim] (`cat(f, f)`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleave:  # pairs (x0, x1), (x2, x3)… each by one frequency; output de-interleaved
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        # With TP a rank runs a slice of the heads; the latent (kv_a) is every rank's whole.
        self.num_heads = shard_size(heads, tp_group().size, "num_attention_heads")
        # The query's first projection and the latent's read the same input: one GEMM (SGLang's
        # fused_qkv_a_proj_with_mqa). The latent's part is whole on every rank.
        latent = ("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, None)
        if cfg.q_lora_rank:
            query = ("q_a_proj", cfg.q_lora_rank, None)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            query = ("q_proj", heads * qk, 1)
        self.fused_qkv_a_proj_with_mqa = PackedColumnLinear(h, [query, latent], bias=False)
        load_unpacked(self)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        out = cfg.qk_nope_head_dim + cfg.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * out, bias=False)
        self.kv_b_proj.keep_dense = True  # its halves are folded into queries and outputs
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, h, bias=False)

    # --- what goes in --------------------------------------------------------------------------

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of hidden states x [tokens, hidden]: the queries ([tokens, heads, nope], [tokens,
        heads, rope]) and the latent [tokens, kv_lora_rank + rope] a KV pool stores."""
        cfg = self.cfg
        q, kv_a = self.fused_qkv_a_proj_with_mqa(x)
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(len(x), self.num_heads, -1)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = rotate(k_rope.unsqueeze(1), cos, sin, cfg.interleave).squeeze(1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)
        return q_nope, rotate(q_rope, cos, sin, cfg.interleave), latent

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as [heads, nope, rank] (keys) and [heads, v, rank] (values)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, -1, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def absorbed_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, rank + rope]: queries that score the stored latents as keys (the key
        half of kv_b_proj folded into q_nope), for a kernel that attends over the pool."""
        w_k, _ = self._up()
        return torch.cat([torch.einsum("qhn,hnr->qhr", q_nope, w_k), q_rope], dim=-1)

    def absorbed_output(self, context: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, v] of the attention-weighted latents [tokens, heads, rank]."""
        _, w_v = self._up()
        return torch.einsum("qhr,hvr->qhv", context, w_v)

    # --- the two forms -------------------------------------------------------------------------

    def _context(
        self, latent: torch.Tensor, queries: int, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The context's c_kv and k_rope, and the mask (causal, queries at the end, when None)."""
        cfg = self.cfg
        c_kv, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        if mask is None:
            mask = causal_mask(queries, latent.shape[-2], latent.device)
        return c_kv, k_rope, mask

    def attend_expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """[queries, heads, v] over the context `latent` [context, rank + rope], with its
        latents up-projected to per-head keys and values. `mask` [queries, context] (True =
        attend), None for causal with queries at the end of the context."""
        cfg = self.cfg
        c_kv, k_rope, mask = self._context(latent, len(q_nope), mask)
        kv = self.kv_b_proj(c_kv).view(len(c_kv), self.num_heads, -1).transpose(0, 1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(self.num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [heads, queries, qk]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scaling)
        return out.transpose(0, 1)

    def attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The same result as `attend_expanded`, in the latent space: the cached latents are
        read as they are, never up-projected. Takes leading batch dimensions: queries
        [..., queries, heads, *], `latent` [..., context, rank + rope], `mask` [..., queries,
        context] → [..., queries, heads, v]."""
        c_kv, k_rope, mask = self._context(latent, q_nope.shape[-3], mask)
        w_k, w_v = self._up()
        q_latent = torch.einsum("...qhn,hnr->...hqr", q_nope, w_k)  # the key half folded into q
        shared = c_kv.unsqueeze(-3)  # [..., 1, context, rank]: one latent serves every head
        scores = q_latent @ shared.transpose(-1, -2)
        scores = scores + torch.einsum("...qhe,...ce->...hqc", q_rope, k_rope)
        scores = (scores * self.cfg.scaling).masked_fill(~mask.unsqueeze(-3), float("-inf"))
        ctx = scores.softmax(-1) @ shared  # [..., heads, queries, rank]
        # The value half folded into the output.
        return torch.einsum("...hqr,hvr->...qhv", ctx, w_v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of x [tokens, hidden] over itself (a prefill with no cache)."""
        q_nope, q_rope, latent = self.project(x, cos, sin)
        out = self.attend_expanded(q_nope, q_rope, latent, None)
        return self.o_proj(out.reshape(len(x), -1))
