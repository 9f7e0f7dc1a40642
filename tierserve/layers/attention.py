"""Attention backends behind one interface, chosen by name (`--attention-backend`).

A backend is prepared once per forward step with the batch layout, then called per layer: it
stores the new K/V in the pool and attends over each sequence's whole context, or, for a layer
with a sliding window, its last `window` positions (the pool still holds every token: other
layers and later requests sharing the prefix need them). The torch backend (gather from the pool
+ SDPA) is the CPU path and the oracle for any faster kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.cache import PagedKV
from tierserve.layers.decode_workspace import DecodeWorkspace, _Group
from tierserve.layers.forward_batch import ForwardBatch, SeqSpan, causal_mask

if TYPE_CHECKING:
    from tierserve.layers.mla import MLA


class AttentionBackend(ABC):
    def __init__(self, pool: PagedKV) -> None:
        self.pool = pool

    def adopt(self, model: nn.Module) -> None:
        """Called once with each model this backend serves: a backend with kernels of its own
        for other layers' ops (the CPU backend's norms and rotary) hands them over here."""
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [tokens, heads, dim], k/v: [tokens, kv_heads, dim] -> [tokens, heads, dim]. With a
        `window`, a query at position i attends to keys at positions (i - window, i]."""

    @abstractmethod
    def forward_latent(
        self, layer: int, mla: MLA, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        """MLA: q_nope/q_rope [tokens, heads, *], latent [tokens, rank + rope] (what the pool
        stores) -> [tokens, heads, v_head_dim]. Decode rows attend in the latent space."""


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
        self._prepare_extend(self.extend)

    def _prepare_extend(self, spans: list[SeqSpan]) -> None:
        """The masks of the spans attended one by one with SDPA."""
        self.extend = spans
        device = self.batch.out_slots.device
        self.extend_masks = [_bottom_right_causal(s.q_len, s.kv_len, device) for s in spans]
        # Sliding-window masks by window, one per extend span: built by the first layer that
        # needs them and shared by the step's other layers with that window.
        self.window_masks: dict[int, list[torch.Tensor | None]] = {}

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        self.pool.write(layer, self.batch.out_slots, k, v)
        k, v = self.pool.as_stored(k), self.pool.as_stored(v)
        nd = self.num_decode
        if nd == len(q):
            return self._decode(layer, q, k, v, window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], k[:nd], v[:nd], window)
        self._attend_extend(layer, q, k, v, window, out)
        return out

    def _attend_extend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        out: torch.Tensor,
    ) -> None:
        """The extend spans' rows of `out`, each span with one SDPA call."""
        for span, mask in zip(self.extend, self._extend_masks(window), strict=True):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._extend(layer, span, q[rows], k[rows], v[rows], mask)

    def _extend_masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Each extend span's mask for a layer with this sliding window (None: causal only)."""
        if window is None:
            return self.extend_masks
        if window not in self.window_masks:
            device = self.batch.out_slots.device
            self.window_masks[window] = [
                _windowed_causal(s.q_len, s.kv_len, window, device) for s in self.extend
            ]
        return self.window_masks[window]

    def forward_latent(
        self, layer: int, mla: MLA, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.batch.out_slots, latent.unsqueeze(1))
        latent = self.pool.as_stored(latent)
        out = q_nope.new_empty(*q_nope.shape[:2], mla.cfg.v_head_dim)
        for g in self.workspace.groups if self.num_decode else ():
            # The absorbed form: the group's cached latents [B, capacity, dim] as they are.
            context = self.workspace.context(g, layer, latent[g.rows].unsqueeze(1))[0, 0]
            qn, qr = q_nope[g.rows].unsqueeze(1), q_rope[g.rows].unsqueeze(1)  # a query per row
            visible = g.bias == 0
            bands = [
                mla.attend_absorbed(qn[a:b], qr[a:b], context[a:b, :n], visible[a:b, :, :n])
                for a, b, n in g.bands
            ]
            out[g.rows] = torch.cat(bands).squeeze(1)
        self._attend_extend_latent(layer, mla, q_nope, q_rope, latent, out)
        return out

    def _attend_extend_latent(
        self,
        layer: int,
        mla: MLA,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The extend spans' rows of `out` (MLA), each span in the expanded form."""
        for span, mask in zip(self.extend, self.extend_masks, strict=True):
            rows = slice(span.q_start, span.q_start + span.q_len)
            context = latent[rows]
            if span.kv_len > span.q_len:  # a cached prefix or earlier chunks: from the pool
                context = self.pool.gather(layer, self._pages(span))[0, 0, : span.kv_len]
            out[rows] = mla.attend_expanded(q_nope[rows], q_rope[rows], context, mask)

    def _pages(self, span: SeqSpan) -> torch.Tensor:
        return torch.tensor(span.pages, dtype=torch.long, device=self.pool.data.device)

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for g in self.workspace.groups:
            rows = g.rows
            out[rows] = self._decode_group(g, layer, q[rows], k[rows], v[rows], window)
        return out

    def _decode_group(
        self,
        g: _Group,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """One query per sequence: the G query heads that share a KV head are G queries of one
        attention over it, so K/V are never repeated per query head. One fused SDPA call per
        band, which never writes the scores out."""
        kc, vc = self.workspace.context(g, layer, k, v)  # [kv_heads, B, L, dim] each
        b, heads, dim = q.shape
        qg = q.view(b, kc.shape[0], heads // kc.shape[0], dim)  # [B, kv_heads, G, dim]
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)
        bias = g.bias_for(window)[:, None]  # [B, 1, 1, L]: the same for every head and query
        bands = [
            F.scaled_dot_product_attention(
                qg[a:b], kc[a:b, :, :n], vc[a:b, :, :n], bias[a:b, ..., :n]
            )
            for a, b, n in g.bands
        ]
        return torch.cat(bands).reshape(b, heads, dim)

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
            k, v = self.pool.gather(layer, self._pages(span))  # [kv_heads, pages × size, dim]
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


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """None when there is no prefix: then SDPA's own (top-left) causal mask is the same thing."""
    return None if kv_len == q_len else causal_mask(q_len, kv_len, device)


def _windowed_causal(
    q_len: int, kv_len: int, window: int, device: torch.device
) -> torch.Tensor | None:
    """The causal mask, less keys past the window; the plain one when the whole context fits
    in the window (the last query, at kv_len - 1, still sees key 0)."""
    if kv_len <= window:
        return _bottom_right_causal(q_len, kv_len, device)
    return causal_mask(q_len, kv_len, device, window)
