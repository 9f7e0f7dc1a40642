"""Incremental detokenization, O(1) work per token.

A byte-level token can end mid-character; text is released only once its bytes complete a
character, so no piece shows half a character as U+FFFD. With a fast tokenizer, tokenizers'
`DecodeStream` keeps that state in Rust; otherwise a window of the unsettled ids is decoded
(the prefix/read-offset method of vLLM and TGI). Either way the unsettled window is bounded: after
MAX_UNSETTLED ids that never completed a character (a model emitting stray bytes), they are
released as U+FFFD and decoding restarts, so one odd request cannot make each step slower.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
MAX_UNSETTLED = 8  # a character is at most 4 bytes, so 4 byte tokens; twice that is stray bytes


def _rust_backend(tokenizer: Any) -> Any:
    """The tokenizers.Tokenizer behind a fast tokenizer, when this tokenizers has DecodeStream
    (0.21 and later); None sends decoding down the window path."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = _rust_backend(tokenizer)
        self._unsettled: list[int] = []  # ids whose text has not been released yet
        self._settled_tail: list[int] = []  # the window's context: the last released ids
        self._stream = self._new_stream()

    def _new_stream(self) -> Any:
        if self._backend is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes ("" while a character is
        still unfinished)."""
        self._unsettled.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
        else:
            piece = self._window_step()
        if piece is not None:
            if self._stream is None:  # the window path decodes with this context
                self._settled_tail = self._unsettled[-4:]
            self._unsettled = []
            return piece
        if len(self._unsettled) > MAX_UNSETTLED:
            return self._release_unsettled()
        return ""

    def flush(self) -> str:
        """At the end: bytes that never completed a character, shown as U+FFFD."""
        return self._release_unsettled() if self._unsettled else ""

    def _release_unsettled(self) -> str:
        text = self._decode(self._unsettled)
        self._settled_tail, self._unsettled = [], []
        self._stream = self._new_stream()
        return text

    def _window_step(self) -> str | None:
        """Decode the settled context plus the unsettled ids; the difference is the new text,
        unless it ends in a character still incomplete."""
        prefix = self._decode(self._settled_tail)
        full = self._decode(self._settled_tail + self._unsettled)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return None
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        skip = self.skip_special_tokens
        return self.tokenizer.decode(ids, skip_special_tokens=skip) if ids else ""
