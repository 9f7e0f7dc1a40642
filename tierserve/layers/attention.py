"""Attention backends behind one interface, chosen by name (`--attention-backend`).

A backend is prepared once per forward step with the batch layout, then called per layer: it
stores the new K/V in the pool and attends over each sequence's whole context. The torch backend
(gather from the pool + SDPA) is the CPU path and the oracle for any faster kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierserve.cache.pool import KVPool


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
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [tokens, heads, dim], k/v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""


class DecodeWorkspace:
    """The decode batch's K/V, padded and contiguous, kept from one step to the next.

    On CPU, gathering every sequence's whole context from the pool each step costs more than the
    attention itself. While the decode batch is the same sequences, each one token longer, only
    the new tokens are appended; any other change rebuilds it with one gather per layer.
    """

    SLACK = 64  # tokens of room per row, so appends run for a while before a rebuild

    def __init__(self, pool: KVPool, num_layers: int) -> None:
        self.pool = pool
        # On a GPU the gather is cheap and memory is not: there, no copy is kept between steps.
        self.persist = pool.device.type == "cpu"
        self.key: tuple[int, ...] = ()
        self.lens = torch.zeros(0, dtype=torch.long)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = 0

    def plan(self, spans: list[SeqSpan], device: torch.device) -> None:
        key = tuple(s.seq_id for s in spans)
        lens = torch.tensor([s.kv_len for s in spans], device=device)
        self.appending = (
            self.persist
            and key == self.key
            and bool((lens == self.lens + 1).all())
            and int(lens.max()) <= self.capacity
        )
        if not self.appending:
            ps = self.pool.page_size
            slack = self.SLACK if self.persist else 0
            self.capacity = -(-(int(lens.max()) + slack) // ps) * ps
            self.pages = _page_table(spans, self.capacity // ps, device)
        self.key, self.lens = key, lens
        self.rows = torch.arange(len(spans), device=device)
        pad = torch.arange(self.capacity, device=device)[None, :] >= lens[:, None]
        # Added to the scores: 0 for real tokens, -inf for padding ([B, 1, capacity]).
        bias = torch.zeros(pad.shape, device=device).masked_fill_(pad, float("-inf"))
        self.bias = bias[:, None]

    def kv(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, B, capacity, dim] K and V, including this step's tokens."""
        if self.appending:
            self.k[layer][:, self.rows, self.lens - 1] = k_new.transpose(0, 1)
            self.v[layer][:, self.rows, self.lens - 1] = v_new.transpose(0, 1)
            return self.k[layer], self.v[layer]
        k, v = self.pool.gather(layer, self.pages)  # the pool already holds this step's tokens
        if self.persist:
            self.k[layer], self.v[layer] = k, v
        return k, v

    def reset(self) -> None:
        self.key = ()


class TorchAttention(AttentionBackend):
    """Decode tokens of all sequences in one padded call; each extend sequence alone."""

    def __init__(self, pool: KVPool, num_layers: int) -> None:
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
        self.pool.wait_layer(layer)  # pages loaded back from the host for this step
        self.pool.write(layer, self.batch.out_slots, k, v)
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
        """One query per sequence: the G query heads that share a KV head form one matmul
        against it, so K/V are never repeated per query head."""
        kc, vc = self.workspace.kv(layer, k, v)  # [kv_heads, B, L, dim]
        b, heads, dim = q.shape
        kv_heads = kc.shape[0]
        qg = (q * dim**-0.5).view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        scores = (qg @ kc.transpose(-1, -2)).add_(self.workspace.bias)  # [kv_heads, B, G, L]
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


def _page_table(spans: list[SeqSpan], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] page table; padding reads page 0 and is masked out."""
    table = torch.zeros(len(spans), width, dtype=torch.long, device=device)
    for i, s in enumerate(spans):
        table[i, : len(s.pages)] = s.pages
    return table


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i sits at context position kv_len - q_len + i and sees keys up to it.

    None when there is no prefix: then SDPA's own (top-left) causal mask is the same thing.
    """
    if kv_len == q_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


ATTENTION_BACKENDS: dict[str, Callable[[KVPool, int], AttentionBackend]] = {"torch": TorchAttention}
