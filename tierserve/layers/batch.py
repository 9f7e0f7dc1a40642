"""What one forward step runs: a flat batch of tokens from many sequences, and where each
sequence's tokens and context are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in the batch: its new tokens `q_start : q_start + q_len` of the flat batch
    attend to `kv_len` tokens of context (cached prefix + new), stored in `pages`."""

    seq_id: int
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    out_slots: torch.Tensor  # [tokens]: where each new token's K/V goes
    spans: list[SeqSpan]
    # [spans, most pages]: row i is spans[i].pages, padded with page 0 (never read); None
    # when built without one (tests), then made from the spans on first use.
    page_table: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        if self.page_table is not None:
            return self.page_table
        width = max((len(s.pages) for s in self.spans), default=0)
        table = torch.zeros(len(self.spans), width, dtype=torch.long)
        for i, s in enumerate(self.spans):
            table[i, : len(s.pages)] = s.pages
        object.__setattr__(self, "page_table", table)
        return table


def causal_mask(
    q_len: int, kv_len: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """[q_len, kv_len], True where query i, at context position kv_len - q_len + i (the new
    tokens end the context), may attend: keys up to its own position and, with a sliding
    `window`, after its position - window (the window counts the query itself)."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    keys = torch.arange(kv_len, device=device)[None, :]
    mask = keys <= rows
    return mask if window is None else mask & (keys > rows - window)
