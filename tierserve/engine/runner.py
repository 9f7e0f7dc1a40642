"""Runs one scheduled step: flattens the chunks into a ForwardBatch, runs the model, samples."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tierserve.engine.scheduler import ScheduledChunk
from tierserve.layers import (
    AttentionBackend,
    ForwardBatch,
    SeqSpan,
    long_tensor,
    page_table,
    sample,
    token_logprobs,
)
from tierserve.outputs import TokenLogprob
from tierserve.speculative import DraftModelProposer, DraftRows, verify

if TYPE_CHECKING:
    from tierserve.models import CausalLM

# Prompt positions whose logits are materialised at once for prompt logprobs: a chunk of 8K
# tokens over a 128K vocabulary would otherwise take 4 GB of float32 logits.
PROMPT_LOGITS_ROWS = 256


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What one chunk produced: the tokens sampled when it reached its sequence's end (one per
    sampled row: its last known token's, then each draft token's; with their logprobs when
    asked), and the logprobs of the prompt tokens it scored."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # captured rows of prompt positions not captured yet
    draft: tuple[int, ...] = ()  # a draft model's proposal for the request's next step


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        page_size: int,
        device: torch.device,
        capture: tuple[int, ...] = (),
        proposer: DraftModelProposer | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.page_size = page_size
        self.device = device
        self.capture = capture  # layer ids whose hidden states prompts keep (hidden_states.py)
        self.proposer = proposer
        # Layers the forward keeps: the prompts' and, every step, the draft's; the columns of
        # each in `model.model.captured` (its last column is the final norm's input).
        self.layers = tuple(sorted({*capture, *(proposer.aux_layers if proposer else ())}))
        self.capture_cols = [self.layers.index(k) for k in capture] + [len(self.layers)]
        self.aux_cols = [self.layers.index(k) for k in proposer.aux_layers] if proposer else []

    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk]) -> list[ChunkResult]:
        """Each chunk's result, in order."""
        batch = self._build_batch(chunks)
        self.attn.prepare(batch)
        prompts = bool(self.capture) and any(map(_needs_capture, chunks))
        capture = self.layers if prompts or self.aux_cols else ()
        hidden = self.model(batch.input_ids, batch.positions, self.attn, capture)
        results = [ChunkResult()] * len(chunks)
        for i, c in enumerate(chunks):
            scored = []
            if c.req.params.prompt_logprobs is not None:
                scored = self._scored(c, batch.spans[i], hidden)
            rows = self._captured(c, batch.spans[i]) if prompts else None
            if scored or rows is not None:
                results[i] = ChunkResult(prompt_logprobs=scored, hidden=rows)
        # Every sampled row of every chunk in one LM-head call; counted once: each count
        # reads the request's state.
        counts = [c.sampled_rows for c in chunks]
        picked = {}
        if any(counts):
            rows = [
                span.q_start + span.q_len - k
                for span, n in zip(batch.spans, counts, strict=True)
                for k in range(n, 0, -1)
            ]
            sampled = hidden  # every row samples (decode): no gather
            if len(rows) < len(hidden):
                sampled = hidden[long_tensor(rows).to(self.device)]
            logits = self.model.logits(sampled)
            picked = self._pick(chunks, counts, logits)
        # An idle attention group (DP attention) drafts nothing: the draft spans its group only.
        drafts = self._propose(chunks, batch, hidden, picked) if self.proposer and chunks else []
        for i, (tokens, logprobs) in picked.items():
            draft = drafts[i] if drafts else ()
            r = results[i]
            results[i] = ChunkResult(tokens, logprobs, r.prompt_logprobs, r.hidden, draft)
        return results

    def _propose(
        self,
        chunks: list[ScheduledChunk],
        batch: ForwardBatch,
        hidden: torch.Tensor,
        picked: dict[int, tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]]],
    ) -> list[tuple[int, ...]]:
        """The draft model's steps over this step's standing rows: each chunk's next draft."""
        assert self.proposer is not None
        ids = batch.input_ids.tolist()
        rows = []
        for i, (c, span) in enumerate(zip(chunks, batch.spans, strict=True)):
            req, start, q = c.req, c.req.num_computed, span.q_start
            if i in picked:  # the known rows, the drafts kept, then the token sampled after
                tokens = picked[i][0]
                kept = span.q_len - len(c.draft) + len(tokens) - 1
                after = tokens[-1]
            else:  # a prompt chunk short of the prompt's end: the next prompt token
                kept = span.q_len
                end = start + kept
                after = _token_ids(req.prompt_ids, req.output_ids, end, end + 1)[0]
            rows.append(DraftRows(
                req.arrival, q, kept, [*ids[q + 1 : q + kept], after], start, req.kv.pages,
                i in picked and req.may_draft,
            ))  # fmt: skip
        if self.proposer.final_hidden:
            aux = hidden
        else:
            aux = self.model.model.captured[:, self.aux_cols].flatten(1)
        return self.proposer.run(batch, aux, rows)

    def _pick(
        self, chunks: list[ScheduledChunk], counts: list[int], logits: torch.Tensor
    ) -> dict[int, tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]]]:
        """Each sampling chunk's tokens and their logprobs. `logits` holds every chunk's
        sampled rows in order: one row for a plain chunk, 1 + k for a verified draft of k."""
        first = [0, *itertools.accumulate(counts)]  # each chunk's first row in `logits`
        plain = [i for i, n in enumerate(counts) if n and not chunks[i].draft]
        tokens: dict[int, list[int]] = {}
        if plain:  # one sampler call for every plain row
            reqs = [chunks[i].req for i in plain]
            rows = logits if len(plain) == len(logits) else logits[[first[i] for i in plain]]
            sampled = sample(rows, [r.params for r in reqs], [r.generator for r in reqs], reqs)
            tokens = {i: [t] for i, t in zip(plain, sampled, strict=True)}
        for i, c in enumerate(chunks):
            if counts[i] and c.draft:
                rows = logits[first[i] : first[i] + counts[i]]
                req = c.req
                tokens[i] = verify(rows, c.draft, req.params, req.generator, history=req)
        # Logprobs of the tokens kept, row by row, in one call: from the raw logits (`sample`
        # adjusts a copy).
        wants = sorted(i for i in tokens if chunks[i].req.params.logprobs is not None)
        if not wants:
            return {i: (tuple(ts), (None,) * len(ts)) for i, ts in tokens.items()}
        asked = [(i, j) for i in wants for j in range(len(tokens[i]))]
        rows = logits[[first[i] + j for i, j in asked]]
        ks = [chunks[i].req.params.logprobs or 0 for i, _ in asked]
        picked = [tokens[i][j] for i, j in asked]
        found = dict(zip(asked, token_logprobs(rows, picked, ks), strict=True))
        return {
            i: (tuple(ts), tuple(found.get((i, j)) for j in range(len(ts))))
            for i, ts in tokens.items()
        }

    def _scored(
        self, chunk: ScheduledChunk, span: SeqSpan, hidden: torch.Tensor
    ) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens this chunk's positions predict, from the first one
        not scored yet (a recompute after preemption scores nothing twice)."""
        req, start = chunk.req, chunk.req.num_computed
        first = max(start, len(req.prompt_logprobs))
        last = min(start + chunk.num_tokens, len(req.prompt_ids) - 1)
        k = req.params.prompt_logprobs or 0
        out: list[TokenLogprob] = []
        for lo in range(first, last, PROMPT_LOGITS_ROWS):
            hi = min(lo + PROMPT_LOGITS_ROWS, last)
            rows = torch.arange(lo - start, hi - start, device=self.device) + span.q_start
            targets = req.prompt_ids[lo + 1 : hi + 1]
            out += token_logprobs(self.model.logits(hidden[rows]), targets, [k] * len(targets))
        return out

    def _captured(self, chunk: ScheduledChunk, span: SeqSpan) -> torch.Tensor | None:
        """This chunk's captured rows for the prompt positions not captured yet (a recompute
        after preemption captures nothing twice), on the host."""
        req, start = chunk.req, chunk.req.num_computed
        first = max(start, req.num_captured)
        last = min(start + chunk.num_tokens, len(req.prompt_ids))
        if not req.captures or first >= last:
            return None
        rows = self.model.model.captured[span.q_start + first - start : span.q_start + last - start]
        if self.layers != self.capture:  # the draft's layers are kept too, repeats once
            rows = rows[:, self.capture_cols]
        return rows.to("cpu", non_blocking=rows.device.type == "cuda")

    def _build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """The step's flat batch. Token ids and page lists are gathered as Python lists and
        become one tensor each; positions and slots are computed from them as tensors (a
        decode step of 64 rows once made ~5 small tensors per row, then a Python int each)."""
        ids: list[int] = []
        tables: list[list[int]] = []
        starts: list[int] = []
        rows: list[int] = []
        ps = self.page_size
        for c in chunks:
            req, n = c.req, c.num_rows
            start = req.num_computed
            page_list = req.kv.pages[: -(-(start + n) // ps)]
            tables.append(page_list)
            starts.append(start)
            rows.append(n)
            ids.extend(_token_ids(req.prompt_ids, req.output_ids, start, start + n - len(c.draft)))
            ids.extend(c.draft)
        table = page_table(tables)
        spans, q_start = [], 0
        for i, (c, pages) in enumerate(zip(chunks, tables, strict=True)):
            spans.append(SeqSpan(c.req.arrival, q_start, rows[i], starts[i] + rows[i], pages))
            q_start += rows[i]
        positions, slots = _positions_and_slots(tables, table, starts, rows, ps)
        device = self.device
        return ForwardBatch(
            # int64 even when empty: an idle attention group's batch (DP attention)
            input_ids=long_tensor(ids).to(device),
            positions=positions.to(device),
            out_slots=slots.to(device),
            spans=spans,
            page_table=table.to(device),
        )


def _positions_and_slots(
    tables: list[list[int]],
    table: torch.Tensor,
    starts: list[int],
    rows: list[int],
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's position (its sequence's start plus its place in the chunk) and KV slot
    (the page the position falls in, from that sequence's row of `table`). A step of one row
    per sequence (decode) computes them in Python: a tenth of the tensor ops' time at 64 rows."""
    if sum(rows) == len(rows):  # one row each: every chunk has one at least
        ps = page_size
        slots = [pages[s // ps] * ps + s % ps for pages, s in zip(tables, starts, strict=True)]
        return long_tensor(starts), long_tensor(slots)
    counts = torch.tensor(rows, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(rows)), counts)
    first_row = torch.cumsum(counts, 0) - counts  # each sequence's first row in the batch
    offset = torch.arange(len(seq)) - first_row[seq]
    positions = torch.tensor(starts, dtype=torch.long)[seq] + offset
    slots = table[seq, positions // page_size] * page_size + positions % page_size
    return positions, slots


def _needs_capture(chunk: ScheduledChunk) -> bool:
    req = chunk.req
    return req.captures and req.num_captured < len(req.prompt_ids)


def _token_ids(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens start..end of prompt + output, without joining the two lists."""
    n = len(prompt)
    if start >= n:
        return output[start - n : end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[: end - n]
