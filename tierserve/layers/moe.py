"""Mixture of experts as DeepSeek-V2 and V3 (and Kimi-K2, which reuses V3) route it.

A router scores every expert per token and keeps `top_k`:
- V3 (`scoring="sigmoid"`, "noaux_tc"): sigmoid scores; the choice adds the learned
  `e_score_correction_bias` (load balancing without an auxiliary loss) but the weights do not;
  only the `topk_group` groups whose two best biased scores sum highest are eligible; weights
  are optionally renormalized (`norm_topk_prob`), then scaled by `routed_scaling_factor`.
- V2 (`scoring="softmax"`): softmax scores, plain top-k ("greedy") or top-k within the
  `topk_group` groups with the highest single score ("group_limited_greedy"), then scaled.
Shared experts see every token. Parameter names are those of transformers' modules, with the
routed experts stacked ([experts, 2 × intermediate, hidden] gate/up, [experts, hidden,
intermediate] down) so one index picks an expert's matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.layers.cpu_linear import linear
from tierserve.layers.mlp import GatedMLP
from tierserve.layers.parallel import all_reduce, mark_shard, shard_size, tp_group

if TYPE_CHECKING:
    from tierserve.layers.quantized import QuantizedWeight


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    scoring: Literal["sigmoid", "softmax"]  # V3 / V2
    topk_method: Literal["noaux_tc", "greedy", "group_limited_greedy"]
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


class TopKRouter(nn.Module):
    # Kept in float32 whatever the model's dtype (as transformers does): the biased scores
    # decide which experts run, and bf16 rounding would flip near-ties.
    keep_in_fp32 = True
    e_score_correction_bias: torch.Tensor  # a buffer, with sigmoid scoring only

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.scoring == "sigmoid":  # V2 checkpoints have none
            # V3's load-balancing bias: it changes which experts are chosen, not their weights.
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, top_k] weights and expert indices; routing runs in float32."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        if cfg.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = self._in_top_groups(scores + self.e_score_correction_bias, by_top2=True)
            indices = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, indices)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if cfg.topk_method == "group_limited_greedy":
                scores = self._in_top_groups(scores, by_top2=False, fill=0.0)
            weights, indices = scores.topk(cfg.top_k, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, indices

    def _in_top_groups(
        self, scores: torch.Tensor, by_top2: bool, fill: float = float("-inf")
    ) -> torch.Tensor:
        """`scores` with every expert outside the `topk_group` best groups set to `fill`. A
        group's score is the sum of its two best (V3) or its best (V2)."""
        cfg = self.cfg
        grouped = scores.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        if by_top2:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), fill).view_as(scores)


class Experts(nn.Module):
    """The routed experts' gated MLPs, stacked. With TP each rank holds a slice of every
    expert's intermediate features (SGLang's default, not expert parallelism): gate and up
    column-wise, down row-wise; the caller sums the ranks' partial outputs."""

    # Parameters, or QuantizedWeights once models/quantization.py quantized them.
    gate_up_proj: nn.Parameter | QuantizedWeight
    down_proj: nn.Parameter | QuantizedWeight
    tp_shards: dict[str, tuple[int, int, int]]  # set by mark_shard

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        tp = tp_group()
        e, h = cfg.num_experts, cfg.hidden_size
        i = shard_size(cfg.moe_intermediate_size, tp.size, "moe_intermediate_size")
        self.num_experts, self.intermediate = e, i  # this rank's intermediate features
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # of each expert's gate and up, loaded apart
        mark_shard(self, "gate_up_proj", -2, tp.rank, tp.size)
        mark_shard(self, "down_proj", -1, tp.rank, tp.size)

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each token through its chosen experts, weighted; one matmul per expert in use."""
        out = torch.zeros_like(x)
        flat = indices.reshape(-1)
        order = flat.argsort()
        token_of = order // indices.shape[1]  # the token each sorted choice belongs to
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            # Each expert's GEMM on its rows only, whatever the weights' format (a quantized
            # one's `[expert]` is that expert's kernel: layers/quantized.py).
            gate, up = linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = linear(F.silu(gate).mul_(up), self.down_proj[expert])
            w = weights.reshape(-1)[picks].unsqueeze(-1).to(y.dtype)
            out.index_add_(0, tokens, y * w)
        return out


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.tp = tp_group()
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] → [tokens, hidden]."""
        weights, indices = self.gate(x)
        out = all_reduce(self.experts(x, indices, weights), self.tp)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
