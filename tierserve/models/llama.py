"""Llama family in plain PyTorch: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm);
Mistral's and Qwen's sliding windows, per layer, as config.json sets them.

The family's attention and MLP; the layer stack, embeddings and LM head are models/decoder.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from tierserve.layers import (
    AttentionBackend,
    GatedMLP,
    PackedColumnLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    load_unpacked,
    shard_size,
    tp_group,
)
from tierserve.model_config import ModelConfig
from tierserve.models.decoder import CausalLM


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        in_features: int | None = None,  # an EAGLE-3 draft layer's: 2 × hidden
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.window = cfg.window(layer_id)  # Mistral, some Qwen layers: a sliding window
        # This rank's heads: a slice of the query heads, and of the KV heads or, when there
        # are more ranks than KV heads, the one KV head its query heads read (replicated).
        tp, hidden, dim = tp_group().size, cfg.hidden_size, cfg.head_dim
        self.num_heads = shard_size(cfg.num_heads, tp, "num_attention_heads")
        replicas = max(1, tp // cfg.num_kv_heads)
        self.num_kv_heads = shard_size(cfg.num_kv_heads * replicas, tp, "num_key_value_heads")
        self.head_dim = dim
        # q, k and v in one GEMM; an EAGLE-3 draft layer (2 × hidden in) packs the same way.
        kv = cfg.num_kv_heads * dim
        in_features = in_features or hidden
        parts = [
            ("q_proj", cfg.num_heads * dim, 1),
            ("k_proj", kv, replicas),
            ("v_proj", kv, replicas),
        ]
        self.qkv_proj = PackedColumnLinear(in_features, parts, cfg.attention_bias)
        load_unpacked(self)
        self.o_proj = RowParallelLinear(cfg.num_heads * dim, hidden, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = attn.forward(self.layer_id, q, k, v, window=self.window)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def attention_part(cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return LlamaAttention(cfg, layer_id, rotary)

    @staticmethod
    def mlp_part(cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
