"""The decode batch's context, padded and contiguous, kept from one step to the next (CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierserve.cache import PagedKV
from tierserve.layers.forward_batch import SeqSpan, page_table


@dataclass
class _Group:
    """Decode rows padded to one capacity; their context lives in `kv`, one
    [parts, heads, B, cap, dim] tensor per layer (K and V, or the MLA latent)."""

    row_ids: list[int]  # indices into the decode rows, longest first
    rows: torch.Tensor  # the same, on the device
    capacity: int
    pages: torch.Tensor  # [B, capacity / page_size] page table; padding reads page 0
    lens: torch.Tensor
    bias: torch.Tensor | None = None  # [B, 1, capacity]: 0 for real tokens, -inf for padding
    arange: torch.Tensor | None = None
    kv: list[torch.Tensor | None] = field(default_factory=list)
    appending: bool = False
    # This step's bias for each sliding window, built by the first layer with that window.
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    # (first row, end row, context length): row ranges attended over their own longest
    # context only. Attention on CPU is bound by the bytes it reads, so padding costs time.
    bands: list[tuple[int, int, int]] = field(default_factory=list)

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

    Padding is memory, not time: a group's rows are kept longest first and attended in bands
    of similar lengths, each over its own longest context (`_Group.bands`).
    """

    MAX_PADDING = 2
    MIN_ROOM = 64
    # A band's shortest row is at least 7/8 of its longest; a group has at most MAX_BANDS, as
    # each is one more attention call per layer.
    BAND_SPREAD = 7 / 8
    MAX_BANDS = 8

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
                g.lens = lens[g.rows]
                g.appending = int(g.lens.max()) <= g.capacity
                if not g.appending:
                    self._reset_group(g, spans)
            if self.tokens > self.MAX_PADDING * self.live_tokens(spans):
                self.groups = self._group(spans, lens)  # lengths drifted apart: regroup
        else:
            self.groups = self._group(spans, lens)
        self.key = key
        for g in self.groups:
            g.bands = self._bands([spans[i].kv_len for i in g.row_ids])
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
        out = []
        for rows, cap in zip(groups, capacities, strict=True):
            index = torch.tensor(rows, device=lens.device)
            g = _Group(rows, index, cap, torch.empty(0), lens[index])
            self._reset_group(g, spans, cap)
            out.append(g)
        return out

    def _bands(self, lengths: list[int]) -> list[tuple[int, int, int]]:
        """Split a group's rows (longest first) where a row falls below BAND_SPREAD x its
        band's longest, so each band reads little padding."""
        bands: list[tuple[int, int, int]] = []
        start, longest = 0, lengths[0]
        for i, n in enumerate(lengths[1:], 1):
            if n < self.BAND_SPREAD * longest and len(bands) < self.MAX_BANDS - 1:
                bands.append((start, i, longest))
                start, longest = i, n
            longest = max(longest, n)
        bands.append((start, len(lengths), longest))
        return bands

    def _capacity(self, length: int) -> int:
        ps = self.pool.page_size
        # Room to grow before the next gather: a quarter of the row, at least MIN_ROOM tokens,
        # never more than the row itself (so one row stays within MAX_PADDING x its pages).
        room = min(length, max(length // 4, self.MIN_ROOM)) if self.persist else 0
        return -(-(length + room) // ps) * ps

    def _reset_group(self, g: _Group, spans: list[SeqSpan], capacity: int | None = None) -> None:
        g.capacity = capacity or self._capacity(int(g.lens.max()))
        # Padding reads page 0 and is masked out.
        rows = [spans[i].pages for i in g.row_ids]
        g.pages = page_table(rows, g.capacity // self.pool.page_size).to(g.lens.device)
        g.kv = [None] * self.num_layers
        g.appending = False

    def context(self, g: _Group, layer: int, *new: torch.Tensor) -> torch.Tensor:
        """[parts, heads, B, capacity, dim]: group `g`'s context including this step's tokens
        `new` (one [B, heads, dim] tensor per part, as stored)."""
        if g.appending:
            kv = g.kv[layer]
            # Appending only follows a step over the same rows, which stored every layer's kv.
            assert kv is not None
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
