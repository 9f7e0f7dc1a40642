"""Runs one scheduled step: flattens the chunks into a ForwardBatch, runs the model, samples."""

from __future__ import annotations

import torch
from torch import nn

from tierserve.engine.scheduler import ScheduledChunk
from tierserve.layers.attention import AttentionBackend, ForwardBatch, SeqSpan
from tierserve.layers.sampler import TokenLogprob, sample, token_logprobs

Sampled = tuple[int, TokenLogprob | None]  # a token, and its logprobs when the request asks


class ModelRunner:
    def __init__(
        self, model: nn.Module, attn: AttentionBackend, page_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.attn = attn
        self.page_size = page_size
        self.device = device
        self._page_offsets = torch.arange(page_size, device=device)

    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk]) -> list[Sampled | None]:
        """The sampled token (and its logprobs, when asked) of each chunk that reaches its
        sequence's end, else None."""
        batch = self._build_batch(chunks)
        self.attn.prepare(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attn)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return [None] * len(chunks)
        rows = torch.tensor([batch.spans[i].q_start + chunks[i].num_tokens - 1 for i in sampling])
        logits = self.model.logits(hidden[rows.to(self.device)])
        reqs = [chunks[i].req for i in sampling]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        asked = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
        if asked:  # from the raw logits: `sample` adjusts a copy
            ks = [reqs[j].params.logprobs or 0 for j in asked]
            found = token_logprobs(logits[asked], [tokens[j] for j in asked], ks)
            for j, lp in zip(asked, found, strict=True):
                logprobs[j] = lp
        out: list[Sampled | None] = [None] * len(chunks)
        for i, token, lp in zip(sampling, tokens, logprobs, strict=True):
            out[i] = (token, lp)
        return out

    def _build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        ids: list[int] = []
        positions, out_slots, spans = [], [], []
        for c in chunks:
            start, end = c.req.num_computed, c.req.num_computed + c.num_tokens
            pages = torch.tensor(c.req.kv.pages[: -(-end // self.page_size)], device=self.device)
            spans.append(SeqSpan(c.req.arrival, len(ids), c.num_tokens, end, pages))
            ids.extend(c.req.all_ids[start:end])
            positions.append(torch.arange(start, end))
            out_slots.append(self._slots(pages, start, end))
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.cat(positions).to(self.device),
            out_slots=torch.cat(out_slots),
            spans=spans,
        )

    def _slots(self, pages: torch.Tensor, start: int, end: int) -> torch.Tensor:
        first = start // self.page_size
        slots = (pages[first:, None] * self.page_size + self._page_offsets).flatten()
        return slots[start - first * self.page_size : end - first * self.page_size]
