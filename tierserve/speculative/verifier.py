"""Verification: one target forward scored the request's last known token and its k draft
tokens; this keeps the drafts the target agrees with and adds the target's own next token.

- Greedy: the target's argmax at each row; drafts are kept while they equal it, so the output is
  the one plain decoding gives, token for token.
- Sampled: the standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023)
  for a draft that proposes one token with certainty (n-gram): draft token x at row i is kept
  with probability p_i(x) under the target's filtered distribution; a rejected row samples from
  p_i with x removed and renormalised (max(p - q, 0) for a one-hot q). Each output token is then
  distributed as plain sampling's. Rows after the first rejection are discarded.

A request whose logits the sampler adjusts from its history (penalties, logit_bias,
min_tokens) has each row adjusted as plain decoding would have adjusted it: row i sees the
output so far plus the i drafts before it, which are its output exactly when they are kept. A
grammar masks row i in the state after the i drafts before it (the matcher steps through the
draft and rolls back; a draft token the grammar refuses ends the draft there), so only tokens
the grammar allows are ever kept or sampled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierserve.layers import Constraint, History, adjust_logits, filtered_probs, greedy_tokens
from tierserve.sampling_params import SamplingParams

# The acceptance test of a sampled draft token: (uniform draw, target probability) -> keep.
AcceptRule = Callable[[float, float], bool]


def keep_with_target_probability(u: float, p: float) -> bool:
    return u < p


@dataclass
class SpecStats:
    """vLLM's counters: verify steps with drafts, drafted and accepted tokens, and accepted
    tokens by draft position (mean acceptance length = 1 + accepted / drafts)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for pos in range(accepted):
            self.accepted_per_position[pos] += 1

    def counts(self) -> list[int]:
        """The counters as one list (an attention group's report to rank 0)."""
        head = [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens]
        return head + self.accepted_per_position

    def add_since(self, now: list[int], before: list[int]) -> None:
        """Add what another group's `counts()` gained between two reports."""
        drafts, tokens, accepted, *per = (
            a - b for a, b in itertools.zip_longest(now, before, fillvalue=0)
        )
        self.num_drafts += drafts
        self.num_draft_tokens += tokens
        self.num_accepted_tokens += accepted
        grow = len(per) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for pos, n in enumerate(per):
            self.accepted_per_position[pos] += n


@dataclass
class _DraftHistory:
    """What the sampler reads at a draft row: the request's output as it would be had the
    drafts before the row been kept. Every `History` field is here: a field the sampler reads
    that this lacked failed the core's step on a request that set it."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]
    allowed_ids: torch.Tensor | None
    grammar: None = None


def _adjusted(
    logits: torch.Tensor, draft: tuple[int, ...], params: SamplingParams, history: History
) -> torch.Tensor:
    rows = logits.float().clone()
    seen = _DraftHistory(history.prompt_ids, [], history.stop_ids, history.allowed_ids)
    for i in range(len(rows)):
        seen.output_ids = history.output_ids + list(draft[:i])
        adjust_logits(rows[i], params, seen)
    history.allowed_ids = seen.allowed_ids  # made once per request, as plain decoding does
    return rows


def _masked(
    rows: torch.Tensor, draft: tuple[int, ...], grammar: Constraint
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`rows` (a copy) masked row by row through the draft, and the draft cut where the
    grammar refuses a token or ends; the grammar's state is as it was on return."""
    stepped = 0
    try:
        for i in range(len(draft) + 1):
            grammar.mask(rows[i])
            if i == len(draft):
                break
            if not grammar.try_accept(draft[i]):
                draft = draft[:i]
                break
            stepped += 1
            if grammar.ended:  # its stop token: the request ends there, nothing follows
                draft = draft[: i + 1]
                break
    finally:
        grammar.rollback(stepped)
    return rows[: len(draft) + 1], draft


def verify(
    logits: torch.Tensor,
    draft: tuple[int, ...],
    params: SamplingParams,
    generator: torch.Generator | None,
    accept: AcceptRule = keep_with_target_probability,
    history: History | None = None,
) -> list[int]:
    """The tokens a verified chain emits: the kept drafts, then the target's token at the
    first row that disagreed (or after the last draft). `logits`: [len(draft) + 1, vocab];
    `history`: the request, needed when its parameters adjust logits."""
    if params.adjusts_logits:
        assert history is not None, "adjusted rows need the request's history"
        logits = _adjusted(logits, draft, params, history)
        if history.grammar is not None:
            logits, draft = _masked(logits, draft, history.grammar)
    if params.greedy:
        target = greedy_tokens(logits).tolist()
        kept = 0
        while kept < len(draft) and draft[kept] == target[kept]:
            kept += 1
        return [*draft[:kept], target[kept]]
    probs = filtered_probs(logits.float(), [params] * len(logits)).cpu()
    out: list[int] = []
    for i, token in enumerate(draft):
        u = torch.rand(1, generator=generator).item()
        if accept(u, probs[i, token].item()):
            out.append(token)
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        if residual.sum() <= 0:  # p was all on the draft token: it could not be rejected
            out.append(token)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator).item()))
    return out
