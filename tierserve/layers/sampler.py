"""Turns the last position's logits into next tokens, each row with its own parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tierserve.outputs import TokenLogprob
from tierserve.sampling_params import SamplingParams


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Each row's sampled token and top `ks[i]` under log_softmax of the raw logits."""
    logprobs = logits.float().log_softmax(dim=-1)
    rows = torch.arange(len(tokens), device=logits.device)
    chosen_values = logprobs[rows, torch.tensor(tokens, device=logits.device)]
    ranks = ((logprobs > chosen_values[:, None]).sum(dim=-1) + 1).tolist()
    chosen = chosen_values.tolist()
    top_values, top_ids = logprobs.topk(max(ks), dim=-1) if max(ks) else (None, None)
    out = []
    for i, (token, lp, k) in enumerate(zip(tokens, chosen, ks, strict=True)):
        top = ()
        if k and top_ids is not None and top_values is not None:
            top = tuple(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist(), strict=True))
        out.append(TokenLogprob(token, lp, top, ranks[i]))
    return out


class Constraint(Protocol):
    """A grammar's say on the next token (frontend/grammar.py), and for speculative drafts a
    way to step through proposed tokens and back."""

    def mask(self, row: torch.Tensor) -> None: ...

    def try_accept(self, token: int) -> bool: ...

    def rollback(self, tokens: int) -> None: ...

    @property
    def ended(self) -> bool: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end the grammar's output (the model's EOS)."""
        ...


class History(Protocol):
    """What a row's adjustments read: its request's tokens so far, the tokens that stop it,
    and its grammar if it has one."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]

    @property
    def grammar(self) -> Constraint | None: ...

    allowed_ids: torch.Tensor | None  # SamplingParams.allowed_token_ids, once made


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, the first of tied ones (as argmax). float32 rows on CPU go
    through NumPy's argmax, whose loop is vectorised: 18 µs for a 64-row decode step's logits
    (64 × 4,096) where torch's max and argmax took 115 on this machine's two threads. Others
    take `max` along the rows (on a Xeon, torch's argmax took ~3× as long as max)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History] = (),
) -> list[int]:
    """One token per row. Greedy rows take the argmax; the rest sample from filtered probs.
    Rows with penalties or biases have their logits adjusted first; other rows cost nothing."""
    logits = logits.float()
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        logits = logits.clone()
        for i in adjusted:
            adjust_logits(logits[i], params[i], histories[i])
    tokens = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = filtered_probs(logits[rows], [params[i] for i in rows])
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generators[i]).item()
    return tokens.tolist()


def adjust_logits(row: torch.Tensor, p: SamplingParams, h: History) -> None:
    """In place, in vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias, the
    penalties, then the grammar."""
    device = row.device
    if p.allowed_token_ids is not None:
        if h.allowed_ids is None:  # once per request: a long list took ms every step
            h.allowed_ids = torch.tensor(p.allowed_token_ids, device=device)
        allowed = h.allowed_ids
        kept = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept
    if p.bad_words_token_ids:
        banned = banned_by_words(p.bad_words_token_ids, h.output_ids)
        if banned:
            row[torch.tensor(banned, device=device)] = float("-inf")
    banned_stops = p.min_tokens and len(h.output_ids) < p.min_tokens and h.stop_ids
    if banned_stops:
        stops = torch.tensor(sorted(h.stop_ids), device=device)
        row[stops] = float("-inf")
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        row[torch.tensor(ids, device=device)] += torch.tensor(bias, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*h.prompt_ids, *h.output_ids}), device=device)
        logit = row[seen]
        penalty = p.repetition_penalty
        row[seen] = torch.where(logit > 0, logit / penalty, logit * penalty)
    if (p.presence_penalty or p.frequency_penalty) and h.output_ids:
        ids, counts = torch.tensor(h.output_ids, device=device).unique(return_counts=True)
        row[ids] -= counts * p.frequency_penalty + p.presence_penalty
    if h.grammar is not None:
        h.grammar.mask(row)
        if not row.isfinite().any():
            # Nothing is left to sample: the grammar is complete and wants its stop token,
            # which min_tokens holds back (the grammar wins), or it allows no token at all from
            # here. A stop token ends the request, where sampling from nothing failed the step,
            # and with it every request of the server.
            ends = h.stop_ids or h.grammar.stop_ids or (0,)
            row[torch.tensor(sorted(ends), device=device)] = 0.0


def banned_by_words(words: Sequence[tuple[int, ...]], output_ids: Sequence[int]) -> list[int]:
    """vLLM's bad_words: each token sequence's last token, where the output so far ends with
    the tokens before it (a one-token word: always). The prompt is not looked at, as in vLLM."""
    banned = []
    for ids in words:
        before = len(ids) - 1
        if before == 0 or (before <= len(output_ids) and tuple(output_ids[-before:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    # A repetition penalty near 0 (any positive one is valid) divides a positive logit past
    # float32's range: +inf logits tie at the largest finite one, or softmax gives NaN.
    logits = (logits / temps[:, None]).clamp(max=torch.finfo(logits.dtype).max)
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
