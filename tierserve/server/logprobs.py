"""Logprobs in OpenAI's two response shapes: the legacy completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` list (token, logprob,
bytes, top_logprobs). Token strings are each id decoded alone, as vLLM does; `bytes` carries
the UTF-8 of a piece that is only part of a character."""

from __future__ import annotations

from typing import Any

from tierserve.layers.sampler import TokenLogprob


def _piece(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """`offset`: characters of the completion before these tokens (for `text_offset`)."""
    tokens = [_piece(tokenizer, lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_piece(tokenizer, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        piece = _piece(tokenizer, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content}
