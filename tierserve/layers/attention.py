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
    attend to `kv_len` tokens of context (cached prefix + new), stored at `slots`."""

    q_start: int
    q_len: int
    kv_len: int
    slots: torch.Tensor


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


class TorchAttention(AttentionBackend):
    """Decode tokens of all sequences in one padded SDPA call; each extend sequence alone."""

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = batch
        device = batch.out_slots.device
        decode = [s for s in batch.spans if s.q_len == 1]
        self.extend = [s for s in batch.spans if s.q_len > 1]
        self.decode_rows = torch.tensor([s.q_start for s in decode], dtype=torch.long).to(device)
        self.decode_slots, self.decode_mask = _pad_slots(decode, device)
        self.extend_masks = [_bottom_right_causal(s.q_len, s.kv_len, device) for s in self.extend]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.batch.out_slots, k, v)
        out = torch.empty_like(q)
        if len(self.decode_rows):
            out[self.decode_rows] = self._decode(layer, q[self.decode_rows])
        for span, mask in zip(self.extend, self.extend_masks, strict=True):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._extend(layer, span, q[rows], k[rows], v[rows], mask)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.gather(layer, self.decode_slots)  # [B, L, kv_heads, dim]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=self.decode_mask,
            enable_gqa=True,
        )
        return o.squeeze(2)

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
            k, v = self.pool.gather(layer, span.slots)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)


def _pad_slots(
    spans: list[SeqSpan], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Lmax] slot matrix (padding reads slot 0) and a [B, 1, 1, Lmax] validity mask."""
    longest = max((s.kv_len for s in spans), default=0)
    slots = torch.zeros(len(spans), longest, dtype=torch.long, device=device)
    for i, s in enumerate(spans):
        slots[i, : s.kv_len] = s.slots
    lengths = torch.tensor([s.kv_len for s in spans], device=device)
    mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]
    return slots, mask[:, None, None, :]


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i sits at context position kv_len - q_len + i and sees keys up to it.

    None when there is no prefix: then SDPA's own (top-left) causal mask is the same thing.
    """
    if kv_len == q_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


ATTENTION_BACKENDS: dict[str, Callable[[KVPool], AttentionBackend]] = {"torch": TorchAttention}
