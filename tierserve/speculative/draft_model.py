"""Drafts from a draft model (an EAGLE-3 draft, DeepSeek-V3's MTP layer): its steps, run by the
runner right after the target's forward, inside the same engine step (the scheduler is not
consulted between them).

Step 0 runs the draft over every row of the step whose token stands (a prefill chunk's rows,
a decode row, a verified draft's kept rows), each with the token after it and the target's
hidden states there (an EAGLE-3 draft reads its auxiliary layers', an MTP layer its final
state): that writes the draft's KV for those positions (one more layer of the pool, so the radix
tree, the host tier and storage keep it with the target's), and its last row proposes the first
draft token. Steps 1 … k − 1 each add one row per drafting request, fed the previous step's
output and token, at the positions after its last; their KV lands in the request's lookahead
slots (the scheduler reserves them) and is scratch: the next step's step 0 writes those
positions again from the target's states once they are verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.layers import AttentionBackend, ForwardBatch, SeqSpan
from tierserve.speculative.proposer import DraftModel, DraftSource


@dataclass(frozen=True, slots=True)
class DraftRows:
    """One chunk's part in step 0: its first `kept` rows (from `q_start` in the target's
    batch, at positions `start` …) stand, and `next_ids` are the tokens after them."""

    seq_id: int
    q_start: int
    kept: int
    next_ids: list[int]
    start: int
    pages: list[int]  # the request's page table, lookahead slots included
    proposes: bool  # the chunk sampled and its request may draft


class DraftModelProposer:
    """Drafts `num_steps` tokens per request with a draft model, greedily (a one-hot
    proposal: the verifier's rejection rule keeps the target's distribution)."""

    def __init__(
        self,
        draft: DraftModel,
        attn: AttentionBackend,
        num_steps: int,
        max_position: int,
    ) -> None:
        self.draft = draft
        self.attn = attn  # the draft's own: its decode workspace is the draft layer's
        self.num_steps = num_steps
        self.max_position = max_position  # the context's last position
        self.page_size = attn.pool.page_size

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.draft.aux_layers

    @property
    def final_hidden(self) -> bool:
        """Step 0 reads the target's final hidden states (else its `aux_layers`')."""
        return self.draft.final_hidden

    @property
    def lookahead(self) -> int:
        """Slots past a sampling chunk's rows that the draft's later steps write."""
        return self.num_steps - 1

    def draft_for(self, req: DraftSource, k: int) -> tuple[int, ...]:
        return req.next_draft[:k]

    def run(
        self, batch: ForwardBatch, aux: torch.Tensor, chunks: list[DraftRows]
    ) -> list[tuple[int, ...]]:
        """Each chunk's drafts for its next step (() where it does not propose). `aux`:
        [batch rows, len(aux_layers) * hidden] (or the final states: [batch rows, hidden]),
        the target's states at this step's rows."""
        out, last = self._start(batch, aux, chunks)
        proposing = [i for i, c in enumerate(chunks) if c.proposes]
        if not proposing:
            return [()] * len(chunks)
        rows = torch.tensor([last[i] for i in proposing], device=out.device)
        hidden = out[rows]
        tokens = [self.draft.propose(hidden)]
        positions = [chunks[i].start + chunks[i].kept - 1 for i in proposing]
        for _ in range(1, self.num_steps):
            alive = [j for j, p in enumerate(positions) if p < self.max_position]
            if len(alive) < len(positions):  # a chain stops at the context's end
                keep = torch.tensor(alive, dtype=torch.long, device=out.device)
                proposing = [proposing[j] for j in alive]
                positions = [positions[j] for j in alive]
                hidden, tokens = hidden[keep], [t[keep] for t in tokens]
            if not proposing:
                break
            positions = [p + 1 for p in positions]
            hidden = self._chain_step(chunks, proposing, positions, hidden, tokens[-1])
            tokens.append(self.draft.propose(hidden))
        drafts: list[tuple[int, ...]] = [()] * len(chunks)
        if proposing:
            found = torch.stack(tokens, dim=1).tolist()
            for i, row in zip(proposing, found, strict=True):
                drafts[i] = tuple(row)
        return drafts

    def _start(
        self, batch: ForwardBatch, aux: torch.Tensor, chunks: list[DraftRows]
    ) -> tuple[torch.Tensor, list[int]]:
        """Step 0 over every standing row; (its output, each chunk's last row in it)."""
        device = aux.device
        # One-row spans lead, as the attention backends want decode rows first.
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].kept > 1)
        rows: list[int] = []
        ids: list[int] = []
        spans: list[SeqSpan] = []
        last = [0] * len(chunks)
        for i in order:
            c = chunks[i]
            kv_len = c.start + c.kept
            pages = c.pages[: -(-kv_len // self.page_size)]
            spans.append(SeqSpan(c.seq_id, len(rows), c.kept, kv_len, pages))
            rows.extend(range(c.q_start, c.q_start + c.kept))
            ids.extend(c.next_ids)
            last[i] = len(rows) - 1
        index = torch.tensor(rows, dtype=torch.long, device=device)
        step = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=batch.positions[index],
            out_slots=batch.out_slots[index],
            spans=spans,
        )
        self.attn.prepare(step)
        return self.draft.start(aux[index], step.input_ids, step.positions, self.attn), last

    def _chain_step(
        self,
        chunks: list[DraftRows],
        proposing: list[int],
        positions: list[int],
        hidden: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        """One more draft token per proposing chunk, at `positions` (lookahead slots)."""
        ps, device = self.page_size, hidden.device
        spans, slots = [], []
        for j, (i, p) in enumerate(zip(proposing, positions, strict=True)):
            pages = chunks[i].pages[: p // ps + 1]
            spans.append(SeqSpan(chunks[i].seq_id, j, 1, p + 1, pages))
            slots.append(pages[-1] * ps + p % ps)
        step = ForwardBatch(
            input_ids=tokens,
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            out_slots=torch.tensor(slots, dtype=torch.long, device=device),
            spans=spans,
        )
        self.attn.prepare(step)
        return self.draft.step(hidden, tokens, step.positions, self.attn)
