"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: never half a UTF-8 character (a byte-level token can end
mid-character, which decodes to U+FFFD) and never the start of what may become a stop string.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are settled text
        self._read_offset = 0
        self.text = ""  # all settled text (after stop-string truncation)
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Append one generated token; sets `stopped` when a stop string appears."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return  # an incomplete character: wait for the next token
        start = max(0, len(self.text) - self._hold)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._truncate_at_stop(start)

    def _truncate_at_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _flush(self) -> None:
        """At the end, bytes that never completed a character are shown as U+FFFD."""
        if self.stopped or self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self.text += self._decode(self._ids[self._prefix_offset :])[len(prefix) :]
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string start."""
        if finished:
            self._flush()
        end = len(self.text) if finished or not self.stop else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
