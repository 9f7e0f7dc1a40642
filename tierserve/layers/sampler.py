"""Turns the last position's logits into next tokens, each row with its own parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row. Greedy rows take the argmax; the rest sample from filtered probs."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = _filtered_probs(logits[rows], [params[i] for i in rows])
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generators[i]).item()
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    if any(p.top_k > 0 for p in params):
        logits = _top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, torch.tensor([p.top_p for p in params], device=logits.device))
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token when the tokens before it already reach top_p; the first token always stays
    # (also when top_p rounds to 0 in float32).
    drop = (cumulative - sorted_logits.softmax(-1)) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
