"""The shape every supported model shares: token embeddings, pre-norm decoder layers
(attention, then an MLP, each added to the residual stream), a final norm and an LM head.

A family is a `CausalLM` whose `layer_parts` builds one layer's attention and MLP. Module names
are Hugging Face's (`model.layers.{i}.self_attn`, `.mlp`, `.input_layernorm`, ...), so weights
load by name. `forward(input_ids, positions, attn)` runs a flat batch of tokens from many
sequences; `attn` stores their KV and attends (layers/attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tierserve.layers import (
    AttentionBackend,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rotary_for,
)
from tierserve.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: type[CausalLM]) -> None:
        super().__init__()
        self.rotary = rotary_for(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, *family.layer_parts(cfg, i, self.rotary))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, type(self))
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def layer_parts(
        cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding
    ) -> tuple[nn.Module, nn.Module]:
        """Layer `layer_id`'s attention and MLP."""
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Final hidden states for every token; call `logits` on the rows that sample."""
        return self.model(input_ids, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
