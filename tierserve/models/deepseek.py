"""DeepSeek-V2 and V3 (and Kimi-K2, K2.5, which reuse V3) in plain PyTorch: MLA attention whose
KV pool holds one latent per token, and mixture-of-experts MLPs after the first dense layers.

Parameter names follow the Hugging Face checkpoints except the routed experts, which are stacked
(`experts.gate_up_proj` [experts, 2 × intermediate, hidden], `experts.down_proj`); checkpoints
ship one tensor per expert, and `checkpoint_target` says where each one goes.
"""

from __future__ import annotations

import re
from typing import cast

import torch
from torch import nn

from tierserve.layers import (
    MLA,
    AttentionBackend,
    Experts,
    GatedMLP,
    MLAConfig,
    MoE,
    MoEConfig,
    RotaryEmbedding,
    softmax_scale,
)
from tierserve.model_config import ModelConfig
from tierserve.models.decoder import CausalLM

# A quantized expert's tensors are its weight's buffers (models/quantization.py's names).
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(\.packed|\.scale|\.zero_point)?$"
)


def mla_config(cfg: ModelConfig) -> MLAConfig:
    return MLAConfig(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        scaling=softmax_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.rope_scaling),
        rms_norm_eps=cfg.rms_norm_eps,
    )


def moe_config(cfg: ModelConfig) -> MoEConfig:
    moe = cfg.moe
    assert moe is not None
    return MoEConfig(
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=moe.moe_intermediate_size,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        n_shared_experts=moe.n_shared_experts,
        scoring=moe.scoring,  # type: ignore[arg-type]  # checked by MoEFields.from_dict
        topk_method=moe.topk_method,  # type: ignore[arg-type]
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor,
    )


class DeepseekAttention(MLA):
    """MLA as a decoder layer runs it: the latent goes to the pool, the backend attends."""

    def __init__(self, cfg: MLAConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg)
        self.layer_id = layer_id
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        cos, sin = self.rotary[0].tables(positions)
        q_nope, q_rope, latent = self.project(x, cos, sin)
        out = attn.forward_latent(self.layer_id, self, q_nope, q_rope, latent)
        return self.o_proj(out.reshape(len(x), -1))


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: the config tells them apart (routing)."""

    @staticmethod
    def attention_part(cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekAttention(mla_config(cfg), layer_id, rotary)

    @staticmethod
    def mlp_part(cfg: ModelConfig, layer_id: int) -> nn.Module:
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_id):
            return MoE(moe_config(cfg))
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def checkpoint_target(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        """Where a per-expert checkpoint tensor goes in the stacked experts: (parameter,
        index); None for a tensor loaded by its own name."""
        match = _EXPERT.match(name)
        if match is None:
            return None
        prefix, expert, proj, part = match[1], int(match[2]), match[3], match[4] or ""
        if proj == "down":
            return f"{prefix}.down_proj{part}", (expert,)
        inter = cast(Experts, self.get_submodule(prefix)).intermediate  # this rank's
        half = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
        return f"{prefix}.gate_up_proj{part}", (expert, half)
