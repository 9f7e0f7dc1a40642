"""Verification: one target forward scored the request's last known token and its k draft
tokens; this keeps the drafts the target agrees with and adds the target's own next token.

- Greedy: the target's argmax at each row; drafts are kept while they equal it, so the output is
  the one plain decoding gives, token for token.
- Sampled: the standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023)
  for a draft that proposes one token with certainty (n-gram): draft token x at row i is kept
  with probability p_i(x) under the target's filtered distribution; a rejected row samples from
  p_i with x removed and renormalised (max(p - q, 0) for a one-hot q). Each output token is then
  distributed as plain sampling's. Rows after the first rejection are discarded.

Requests whose logits the sampler adjusts from their history (penalties, biases, min_tokens)
or a grammar are never drafted for (engine/scheduler.py), so the rows here are raw logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierserve.layers import filtered_probs
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


def verify(
    logits: torch.Tensor,
    draft: tuple[int, ...],
    params: SamplingParams,
    generator: torch.Generator | None,
    accept: AcceptRule = keep_with_target_probability,
) -> list[int]:
    """The tokens a verified chain emits: the kept drafts, then the target's token at the
    first row that disagreed (or after the last draft). `logits`: [len(draft) + 1, vocab]."""
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
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
