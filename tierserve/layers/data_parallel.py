"""Data-parallel attention's two moves between the layers (SGLang's `--enable-dp-attention`).

Each attention group (tp / dp ranks) runs attention on its own requests' tokens only, so its KV
pool holds only their KV. The MLP and MoE layers are split over every rank and need every
group's tokens: before them the groups' hidden states are gathered (in group order), after
them each group takes its own rows back. The step starts with one small all-gather of the
groups' token counts; a group with nothing to run still joins every gather with no rows, so no
rank waits forever for it.

The ranks of one group hold the same hidden states (their attention output is all-reduced
within the group), so a rank gathers only from its peers: the ranks at its own position in the
other groups (`peers`; every rank when a group is one rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DPAttention:
    groups: int  # attention groups
    group_rank: int  # this rank's group
    group_size: int  # ranks per group (the attention group's tensor parallelism)
    peers: Any = None  # ProcessGroup of this rank's position in every group (None: all ranks)
    counts: list[int] = field(default_factory=list)  # this step's tokens per group

    def begin_step(self, num_tokens: int, device: torch.device) -> int:
        """Share this group's token count for the step; the node's tokens in all. On the
        model's device: NCCL's group has no CPU tensors."""
        mine = torch.tensor([num_tokens], dtype=torch.long, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.groups)]
        dist.all_gather(parts, mine, group=self.peers)
        self.counts = [int(p) for p in torch.cat(parts).tolist()]
        return sum(self.counts)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[this group's tokens, hidden] → [every group's tokens, hidden], in group order."""
        most = max(self.counts)
        padded = x.new_zeros(most, *x.shape[1:])
        padded[: len(x)] = x
        parts = [torch.empty_like(padded) for _ in range(self.groups)]
        dist.all_gather(parts, padded, group=self.peers)
        return torch.cat([part[:n] for part, n in zip(parts, self.counts, strict=True)])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """This group's rows of a gathered batch."""
        start = sum(self.counts[: self.group_rank])
        return y[start : start + self.counts[self.group_rank]]


_current: DPAttention | None = None


def dp_attention() -> DPAttention | None:
    return _current


def set_dp_attention(dp: DPAttention | None) -> None:
    global _current
    _current = dp
