"""The shape every supported model shares: token embeddings, pre-norm decoder layers
(attention, then an MLP, each added to the residual stream), a final norm and an LM head.

A family is a `CausalLM` whose `attention_part` and `mlp_part` build one layer's attention and
MLP (apart: with data-parallel attention they split over different groups of ranks). Module names
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
    building_attention,
    dp_attention,
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
        if len(x):  # an idle attention group (DP attention) only joins the MLP's collectives
            x = x + self.self_attn(positions, self.input_layernorm(x), attn)
        h = self.post_attention_layernorm(x)
        dp = dp_attention()
        if dp is None:
            return x + self.mlp(h)
        return x + dp.scatter(self.mlp(dp.gather(h)))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: type[CausalLM]) -> None:
        super().__init__()
        self.rotary = rotary_for(cfg)
        with building_attention():  # a group's own tokens: split over its attention group
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, family.attention(cfg, i, self.rotary), family.mlp_part(cfg, i))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Final hidden states; with `capture` (layer ids: k is the output of layer k − 1),
        `self.captured` is [tokens, len(capture) + 1, hidden]: those, then the final norm's
        input."""
        dp = dp_attention()
        if dp is not None and dp.begin_step(len(input_ids), input_ids.device) == 0:
            return self.embed_tokens.weight.new_empty(0, self.norm.weight.shape[0])
        x = self.embed_tokens(input_ids)
        kept = {0: x} if 0 in capture else {}
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, attn)
            if i + 1 in capture:
                kept[i + 1] = x
        if capture:
            self.captured = torch.stack([*(kept[k] for k in capture), x], dim=1)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, type(self))
        # Over the attention group, as SGLang's --enable-dp-lm-head: a group's prompt logprobs
        # take as many LM-head calls as its chunks need, which differ between groups.
        with building_attention():
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention(cls, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        """Layer `layer_id`'s attention, split over the attention group."""
        with building_attention():
            return cls.attention_part(cfg, layer_id, rotary)

    @staticmethod
    def attention_part(cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def mlp_part(cfg: ModelConfig, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s MLP or MoE, split over every rank."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Final hidden states for every token; call `logits` on the rows that sample. With
        `capture`, the layers' hidden states are in `self.model.captured`."""
        return self.model(input_ids, positions, attn, capture)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
