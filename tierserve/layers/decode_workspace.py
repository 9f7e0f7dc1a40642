"""The decode batch's context, padded and contiguous, kept from one step to the next (CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierserve.cache import PagedKV
from tierserve.layers.batch import SeqSpan


@dataclass
class _Group:
    """Decode rows padded to one capacity; their context lives in `kv`, one
    [parts, heads, B, cap, dim] tensor per layer (K and V, or the MLA latent)."""

    rows: torch.Tensor | None  # indices into the decode rows; None = all of them, in order
    capacity: int
    pages: torch.Tensor  # [B, capacity / page_size] page table; padding reads page 0
    lens: torch.Tensor
    bias: torch.Tensor | None = None  # [B, 1, capacity]: 0 for real tokens, -inf for padding
    arange: torch.Tensor | None = None
    kv: list[torch.Tensor | None] = field(default_factory=list)
    appending: bool = False
    # This step's bias for each sliding window, built by the first layer with that window.
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.capacity * len(self.lens)

    def bias_for(self, window: int | None) -> torch.Tensor:
        """`bias` for a layer with a sliding `window` (None: the whole context): also -inf
        at keys at or before the query's position - window (the query is at lens - 1)."""
        assert self.bias is not None, "plan() sets the bias"
        if window is None:
            return self.bias
        bias = self.window_bias.get(window)
        if bias is None:
            keys = torch.arange(self.capacity, device=self.lens.device)[None, :]
            old = keys <= (self.lens - 1 - window)[:, None]  # [B, capacity]
            bias = self.window_bias[window] = self.bias.masked_fill(old[:, None], float("-inf"))
        return bias


class DecodeWorkspace:
    """The decode batch's context, padded and contiguous, kept from one step to the next.

    On CPU, gathering every sequence's whole context from the pool each step costs more than the
    attention itself. While the decode batch is the same sequences, each one token longer, only
    the new tokens are appended; a group that outgrows its capacity is gathered again.

    Bounded: rows are grouped by length so that each group's padded size is at most
    `MAX_PADDING` × the pool pages its sequences occupy (their live KV at page granularity);
    a row gets room to grow of a quarter of its length (at least 64 tokens, at most its
    length). So the workspace never holds more than `MAX_PADDING` × the batch's live KV, and
    the start-up plan counts it as that × the device pool (CPU only: on a GPU nothing is kept
    between steps).
    """

    MAX_PADDING = 2
    MIN_ROOM = 64

    def __init__(self, pool: PagedKV, num_layers: int) -> None:
        self.pool = pool
        self.num_layers = num_layers
        # On a GPU the gather is cheap and memory is not: there, no copy is kept between steps.
        self.persist = pool.device.type == "cpu"
        self.key: tuple[int, ...] = ()
        self.groups: list[_Group] = []

    def plan(self, spans: list[SeqSpan], device: torch.device) -> None:
        key = tuple(s.seq_id for s in spans)
        lens = torch.tensor([s.kv_len for s in spans], device=device)
        if self.persist and key == self.key:
            for g in self.groups:
                g.lens = lens if g.rows is None else lens[g.rows]
                g.appending = int(g.lens.max()) <= g.capacity
                if not g.appending:
                    self._reset_group(g, spans)
            if self.tokens > self.MAX_PADDING * self.live_tokens(spans):
                self.groups = self._group(spans, lens)  # lengths drifted apart: regroup
        else:
            self.groups = self._group(spans, lens)
        self.key = key
        for g in self.groups:
            g.arange = torch.arange(len(g.lens), device=device)
            pad = torch.arange(g.capacity, device=device)[None, :] >= g.lens[:, None]
            g.bias = torch.zeros(pad.shape, device=device).masked_fill_(pad, float("-inf"))[:, None]
            g.window_bias = {}  # the lengths moved: windowed biases are built again on use

    def live_tokens(self, spans: list[SeqSpan]) -> int:
        """The batch's live KV in tokens, at page granularity (what the pool holds for it)."""
        ps = self.pool.page_size
        return sum(-(-s.kv_len // ps) * ps for s in spans)

    def _group(self, spans: list[SeqSpan], lens: torch.Tensor) -> list[_Group]:
        ps = self.pool.page_size
        order = sorted(range(len(spans)), key=lambda i: -spans[i].kv_len)
        groups: list[list[int]] = []
        capacities: list[int] = []
        live = 0
        for i in order:
            pool_tokens = -(-spans[i].kv_len // ps) * ps
            if groups and capacities[-1] * (len(groups[-1]) + 1) <= self.MAX_PADDING * (
                live + pool_tokens
            ):
                groups[-1].append(i)
                live += pool_tokens
                continue
            groups.append([i])
            capacities.append(self._capacity(spans[i].kv_len))
            live = pool_tokens
        if len(groups) == 1:
            groups[0] = list(range(len(spans)))  # batch order: no row shuffling needed
        out = []
        for rows, cap in zip(groups, capacities, strict=True):
            whole = len(groups) == 1
            index = None if whole else torch.tensor(rows, device=lens.device)
            g = _Group(index, cap, torch.empty(0), lens if whole else lens[index])
            self._reset_group(g, spans, cap)
            out.append(g)
        return out

    def _capacity(self, length: int) -> int:
        ps = self.pool.page_size
        # Room to grow before the next gather: a quarter of the row, at least MIN_ROOM tokens,
        # never more than the row itself (so one row stays within MAX_PADDING x its pages).
        room = min(length, max(length // 4, self.MIN_ROOM)) if self.persist else 0
        return -(-(length + room) // ps) * ps

    def _reset_group(self, g: _Group, spans: list[SeqSpan], capacity: int | None = None) -> None:
        rows = range(len(spans)) if g.rows is None else g.rows.tolist()
        g.capacity = capacity or self._capacity(int(g.lens.max()))
        g.pages = _page_table([spans[i] for i in rows], g.capacity // self.pool.page_size)
        g.pages = g.pages.to(g.lens.device)
        g.kv = [None] * self.num_layers
        g.appending = False

    def context(self, g: _Group, layer: int, *new: torch.Tensor) -> torch.Tensor:
        """[parts, heads, B, capacity, dim]: group `g`'s context including this step's tokens
        `new` (one [B, heads, dim] tensor per part, as stored)."""
        if g.appending:
            kv = g.kv[layer]
            for part, x in enumerate(new):
                kv[part][:, g.arange, g.lens - 1] = x.transpose(0, 1)
            return kv
        kv = self.pool.gather(layer, g.pages)  # the pool already holds this step's tokens
        if self.persist:
            g.kv[layer] = kv
        return kv

    @property
    def tokens(self) -> int:
        """Padded token rows the workspace holds (per layer, per part)."""
        return sum(g.tokens for g in self.groups)

    def reset(self) -> None:
        self.key, self.groups = (), []


def _page_table(spans: list[SeqSpan], width: int) -> torch.Tensor:
    """[B, width] page table; padding reads page 0 and is masked out."""
    table = torch.zeros(len(spans), width, dtype=torch.long)
    for i, s in enumerate(spans):
        table[i, : len(s.pages)] = s.pages.cpu()
    return table
