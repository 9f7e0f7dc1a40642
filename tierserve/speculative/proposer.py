"""What the scheduler asks of a proposer, and what a proposer reads of a request."""

from __future__ import annotations

from typing import Protocol

import torch

from tierserve.layers import AttentionBackend


class DraftSource(Protocol):
    """A request as proposers see it (the engine's Request)."""

    next_draft: tuple[int, ...]  # what a draft model proposed after its last step

    def last_ids(self, n: int) -> list[int]: ...


class Proposer(Protocol):
    @property
    def lookahead(self) -> int:
        """Slots past a sampling chunk's rows that proposing writes (a draft model's later
        steps)."""
        ...

    def draft_for(self, req: DraftSource, k: int) -> tuple[int, ...]:
        """Up to `k` tokens to verify after `req`'s last one."""
        ...


class DraftModel(Protocol):
    """A draft model's steps (models/eagle3.py's Eagle3Draft, models/mtp.py's MTPDraft): each
    returns the layer's output at its rows, which the next step reads and `propose` turns
    into target token ids."""

    aux_layers: tuple[int, ...]  # target layer ids whose states step 0 reads (capture ids)
    final_hidden: bool  # step 0 reads the target's final hidden state instead

    def start(
        self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor: ...  # fmt: skip

    def step(  # positional: MTPDraft's step is its start, under start's names
        self, previous: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
        attn: AttentionBackend, /,
    ) -> torch.Tensor: ...  # fmt: skip

    def propose(self, out: torch.Tensor) -> torch.Tensor: ...
