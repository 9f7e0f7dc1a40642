"""Logprobs in OpenAI's two response shapes: the legacy completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` list (token, logprob,
bytes, top_logprobs). Token strings are each id decoded alone, as vLLM does; `bytes` carries
the UTF-8 of a piece that is only part of a character."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tierserve.outputs import TokenLogprob


@functools.lru_cache(maxsize=1 << 17)
def _piece(tokenizer: Any, token_id: int) -> str:
    """Cached: a response asks for the same few thousand ids again and again (an echoed
    1,000-token prompt with 20 alternatives, n 128, was 2.7 M decodes on the event loop)."""
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any, lps: list[TokenLogprob], offset: int, lead: int | None = None
) -> dict[str, Any]:
    """`offset`: characters of the completion before these tokens (for `text_offset`).
    `lead`: a first token that has no logprob (an echoed prompt's first), shown with None."""
    tokens = [_piece(tokenizer, lp.token_id) for lp in lps]
    token_logprobs: list[float | None] = [lp.logprob for lp in lps]
    top: list[dict[str, float] | None] = [
        {_piece(tokenizer, t): v for t, v in lp.top} for lp in lps
    ]
    if lead is not None:
        tokens, token_logprobs, top = (
            [_piece(tokenizer, lead), *tokens],
            [None, *token_logprobs],
            [None, *top],
        )
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs(
    tokenizer: Any, prompt_ids: list[int], lps: list[TokenLogprob], k: int
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first token (nothing predicts it), then for each
    token its own and the `k` most likely tokens', by id: logprob, rank, decoded_token."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": _piece(tokenizer, token_id)}

    out: list[dict[int, dict[str, Any]] | None] = [None]
    for lp in lps[: len(prompt_ids) - 1]:
        scores = {t: entry(t, v, r) for r, (t, v) in enumerate(lp.top[:k], 1)}
        scores.setdefault(lp.token_id, entry(lp.token_id, lp.logprob, lp.rank))
        out.append(scores)
    return out


def fewer_alternatives(lps: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """`lps` with at most `k` alternatives each (an echo asked for fewer than were scored)."""
    if all(len(lp.top) <= k for lp in lps):
        return lps
    return [dataclasses.replace(lp, top=lp.top[:k]) for lp in lps]


def join(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects as one (an echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        piece = _piece(tokenizer, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content}
