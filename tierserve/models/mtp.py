"""DeepSeek-V3's multi-token-prediction layer as a draft (SGLang's NEXTN, vLLM's deepseek_mtp).

The checkpoint ships it as `model.layers.{num_hidden_layers}` (config
`num_nextn_predict_layers: 1`): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and a whole
decoder layer (MLA attention, an MoE MLP). Its `embed_tokens` and `shared_head.head` are copies
of the target's, which it shares here as vLLM and SGLang share them.

At row t it takes the embedding of token t + 1 and the target's final (normed) hidden state at
t, `eh_proj(cat(enorm(embed), hnorm(hidden)))`, runs the decoder layer and predicts token t + 2
with the target's head over `shared_head.norm`; a later step reads its own output at t − 1 in
place of the target's state. The layer's MLA latent is one more layer of the target's pool (pool
layer `num_hidden_layers`), split over ranks exactly as the target's layers are: the latent is
the same on every rank, so pages stay rank-independent and the shared host copy holds it once.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from tierserve.errors import TierserveError
from tierserve.layers import AttentionBackend, ColumnParallelLinear, RMSNorm, pack_for_cpu, tp_group
from tierserve.model_config import ModelConfig, read_hf_config, text_config
from tierserve.models.decoder import CausalLM, DecoderLayer
from tierserve.models.deepseek import DeepseekForCausalLM
from tierserve.models.loader import (
    CheckpointLayout,
    checkpoint_tensors,
    fill,
    materialize,
    tensor_shapes,
    weight_files,
)

FIELD = "speculative_algorithm"
_SHARED = ("embed_tokens.", "shared_head.head.")  # the target's own: never loaded twice
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPDraft(nn.Module):
    """The draft interface the speculative proposer drives (`start`, `step`, `propose`); it
    reads the target's final hidden state (`aux_layers` empty)."""

    aux_layers: tuple[int, ...] = ()
    final_hidden = True
    checkpoint_target = DeepseekForCausalLM.checkpoint_target  # per-expert tensors: stacked

    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__()
        hidden, eps, layer_id = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_layers
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        # Whole on every rank: each rank feeds its attention the same rows.
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, False, tp_group().size)
        rotary = target.model.rotary
        attention = DeepseekForCausalLM.attention(cfg, layer_id, rotary)
        self.layer = DecoderLayer(cfg, attention, DeepseekForCausalLM.mlp_part(cfg, layer_id))
        self.shared_head = SharedHead(hidden, eps)
        # A tuple, not submodules: the target's weights are neither loaded nor counted twice.
        self.target_parts = (target.model.embed_tokens, target.lm_head)

    def start(
        self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """aux: the target's final hidden states at the rows -> the layer's output."""
        embeds = self.enorm(self.target_parts[0](next_ids))
        x = self.eh_proj(torch.cat([embeds, self.hnorm(aux)], dim=-1))
        return self.layer(positions, x, attn)

    step = start  # a later step reads its own output where step 0 read the target's

    def propose(self, out: torch.Tensor) -> torch.Tensor:
        return self.target_parts[1](self.shared_head.norm(out)).argmax(dim=-1)


class MTPLayout(CheckpointLayout):
    """The MTP layer's tensors, by the draft's names; everything else is the target's."""

    def model_name(self, key: str) -> str | None:
        own = f"{self.prefix}model.layers.{self.num_layers}."
        if not key.startswith(own) or key.endswith("_scale_inv"):
            return None
        name = key[len(own) :]
        if name.startswith(_SHARED):
            return None
        return name if name.startswith(_OWN) else "layer." + name


def nextn_layers(model_dir: str | Path) -> int:
    return int(text_config(read_hf_config(Path(model_dir))).get("num_nextn_predict_layers") or 0)


def check_nextn(model_dir: str | Path, cfg: ModelConfig) -> tuple[int, int]:
    """The MTP layer's parameters (`mtp_numels`); a refusal naming why for a model without a
    servable one."""
    if not cfg.kv_lora_rank or cfg.moe is None:
        message = (
            "--speculative-algorithm NEXTN drafts with DeepSeek-V3's MTP layer; "
            f"{cfg.architecture} has none (EAGLE3 with a draft, or NGRAM, serve any model)"
        )
        raise TierserveError(message, FIELD)
    if nextn_layers(model_dir) < 1:
        message = (
            f"--speculative-algorithm NEXTN: {model_dir} ships no MTP layer "
            "(num_nextn_predict_layers is 0, as Kimi-K2's and K2.5's configs say); use EAGLE3 "
            "with a draft, or NGRAM"
        )
        raise TierserveError(message, FIELD)
    numels = mtp_numels(model_dir, cfg.num_layers)
    if numels == (0, 0):
        message = (
            f"--speculative-algorithm NEXTN: config.json says num_nextn_predict_layers 1 but "
            f"{model_dir} holds no model.layers.{cfg.num_layers}.* tensors"
        )
        raise TierserveError(message, FIELD)
    return numels


def mtp_numels(model_dir: str | Path, num_layers: int) -> tuple[int, int]:
    """(parameters of the MTP layer split over the ranks, those whole on every rank: eh_proj
    and the norms) in the checkpoint's headers; the shared embedding and head left out."""
    path = Path(model_dir)
    layout = MTPLayout.of(path, num_layers)
    split = whole = 0
    for file in weight_files(path):
        for key, shape in tensor_shapes(file).items():
            name = layout.model_name(key)
            if name is None:
                continue
            if name.startswith(_OWN) or "norm" in name:
                whole += math.prod(shape)
            else:
                split += math.prod(shape)
    return split, whole


def load_mtp(
    model_dir: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device
) -> MTPDraft:
    path, cfg = Path(model_dir), target.config
    with torch.device("meta"):
        draft = MTPDraft(cfg, target)
    draft = materialize(draft, device, dtype)
    for module in draft.modules():
        if getattr(module, "keep_in_fp32", False):  # the MoE router, as the target's
            module.float()
    targets = draft.state_dict(keep_vars=True)
    tensors = checkpoint_tensors(path, MTPLayout.of(path, cfg.num_layers))
    fill(draft, targets, tensors, f"MTP layer of {path}", FIELD)
    pack_for_cpu(draft)
    return draft.eval()
