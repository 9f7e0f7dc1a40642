"""What one forward step runs: a flat batch of tokens from many sequences, and where each
sequence's tokens and context are."""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import NamedTuple

import torch


class SeqSpan(NamedTuple):
    """One sequence in the batch: its new tokens `q_start : q_start + q_len` of the flat batch
    attend to `kv_len` tokens of context (cached prefix + new), stored in `pages` (page ids, in
    order: a list, as the KV manager keeps them; a tensor per span per step cost the batch's
    build 70 us at batch 64, and the CPU backend reads the batch's one table instead). A tuple:
    a frozen dataclass took 0.7 us more to make, 64 times a step."""

    seq_id: int
    q_start: int
    q_len: int
    kv_len: int
    pages: list[int]


def long_tensor(values: list[int]) -> torch.Tensor:
    """int64 values as a CPU tensor, through a C array: torch.tensor reads a list element by
    element (a batch-64 step's 2,560-entry page table took 137 us that way, 38 us this way)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


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
        if self.page_table is None:
            object.__setattr__(self, "page_table", page_table([s.pages for s in self.spans]))
        assert self.page_table is not None
        return self.page_table


def page_table(rows: list[list[int]], width: int | None = None) -> torch.Tensor:
    """[rows, width] int64: each row's pages, then page 0 (never read); width: the longest
    row's by default. From one flat list: a list per row made the tensor 2x slower."""
    width = max(map(len, rows), default=0) if width is None else width
    flat: list[int] = []
    for pages in rows:
        flat += pages
        flat += [0] * (width - len(pages))
    return long_tensor(flat).view(len(rows), width)


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
