"""Attention backends behind one interface, chosen by name (`--attention-backend`).

A backend is prepared once per forward step with the batch layout, then called per layer: it
stores the new K/V in the pool and attends over each sequence's whole context. The torch backend
(gather from the pool + SDPA) is the CPU path and the oracle for any faster kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierserve.cache.pool import PagedKV


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


class AttentionBackend(ABC):
    def __init__(self, pool: PagedKV) -> None:
        self.pool = pool

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [tokens, heads, dim], k/v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""


@dataclass
class _Group:
    """Decode rows padded to one capacity; their K/V live in `k`/`v`, [kv_heads, B, cap, dim]."""

    rows: torch.Tensor | None  # indices into the decode rows; None = all of them, in order
    capacity: int
    pages: torch.Tensor  # [B, capacity / page_size] page table; padding reads page 0
    lens: torch.Tensor
    bias: torch.Tensor | None = None  # [B, 1, capacity]: 0 for real tokens, -inf for padding
    arange: torch.Tensor | None = None
    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)
    appending: bool = False

    @property
    def tokens(self) -> int:
        return self.capacity * len(self.lens)


class DecodeWorkspace:
    """The decode batch's K/V, padded and contiguous, kept from one step to the next.

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
        g.k, g.v = [None] * self.num_layers, [None] * self.num_layers
        g.appending = False

    def kv(
        self, g: _Group, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, B, capacity, dim] K and V of group `g`, including this step's tokens."""
        if g.appending:
            g.k[layer][:, g.arange, g.lens - 1] = k_new.transpose(0, 1)
            g.v[layer][:, g.arange, g.lens - 1] = v_new.transpose(0, 1)
            return g.k[layer], g.v[layer]
        k, v = self.pool.gather(layer, g.pages)  # the pool already holds this step's tokens
        if self.persist:
            g.k[layer], g.v[layer] = k, v
        return k, v

    @property
    def tokens(self) -> int:
        """Padded token rows the workspace holds (per layer, per K or V)."""
        return sum(g.tokens for g in self.groups)

    def reset(self) -> None:
        self.key, self.groups = (), []


class TorchAttention(AttentionBackend):
    """Decode tokens of all sequences in one padded call; each extend sequence alone."""

    def __init__(self, pool: PagedKV, num_layers: int) -> None:
        super().__init__(pool)
        self.workspace = DecodeWorkspace(pool, num_layers)

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = batch
        device = batch.out_slots.device
        decode = [s for s in batch.spans if s.q_len == 1]
        self.extend = [s for s in batch.spans if s.q_len > 1]
        # The runner puts decode tokens first, so they are rows [0, num_decode).
        assert all(s.q_start == i for i, s in enumerate(decode)), "decode rows must lead"
        self.num_decode = len(decode)
        if decode:
            self.workspace.plan(decode, device)
        else:
            self.workspace.reset()
        self.extend_masks = [_bottom_right_causal(s.q_len, s.kv_len, device) for s in self.extend]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.batch.out_slots, k, v)
        k, v = self.pool.as_stored(k), self.pool.as_stored(v)
        nd = self.num_decode
        if nd == len(q):
            return self._decode(layer, q, k, v)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], k[:nd], v[:nd])
        for span, mask in zip(self.extend, self.extend_masks, strict=True):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._extend(layer, span, q[rows], k[rows], v[rows], mask)
        return out

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        groups = self.workspace.groups
        if len(groups) == 1:
            return self._decode_group(groups[0], layer, q, k, v)
        out = torch.empty_like(q)
        for g in groups:
            rows = g.rows
            out[rows] = self._decode_group(g, layer, q[rows], k[rows], v[rows])
        return out

    def _decode_group(
        self, g: _Group, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """One query per sequence: the G query heads that share a KV head form one matmul
        against it, so K/V are never repeated per query head."""
        kc, vc = self.workspace.kv(g, layer, k, v)  # [kv_heads, B, L, dim]
        b, heads, dim = q.shape
        kv_heads = kc.shape[0]
        qg = (q * dim**-0.5).view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        scores = (qg @ kc.transpose(-1, -2)).add_(g.bias)  # [kv_heads, B, G, L]
        out = scores.softmax(-1).to(vc.dtype) @ vc  # [kv_heads, B, G, dim]
        return out.transpose(0, 1).reshape(b, heads, dim)

    def _extend(
        self,
        layer: int,
        span: SeqSpan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if span.kv_len > span.q_len:  # a cached prefix or earlier chunks: read it from the pool
            k, v = self.pool.gather(layer, span.pages)  # [kv_heads, pages * page_size, dim]
            k, v = k[:, : span.kv_len], v[:, : span.kv_len]
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)


def _page_table(spans: list[SeqSpan], width: int) -> torch.Tensor:
    """[B, width] page table; padding reads page 0 and is masked out."""
    table = torch.zeros(len(spans), width, dtype=torch.long)
    for i, s in enumerate(spans):
        table[i, : len(s.pages)] = s.pages.cpu()
    return table


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i sits at context position kv_len - q_len + i and sees keys up to it.

    None when there is no prefix: then SDPA's own (top-left) causal mask is the same thing.
    """
    if kv_len == q_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


ATTENTION_BACKENDS: dict[str, Callable[[PagedKV, int], AttentionBackend]] = {
    "torch": TorchAttention
}
