"""How deeply a JSON body nests, measured on its bytes as they arrive, before anything parses it.

Python's JSON parser, pydantic and our own walks recurse once per level: a body nested a few
hundred levels deep raised RecursionError inside them (a 500). Counting brackets outside strings
bounds every walk that comes after. Only the structural bytes are visited (a regular expression
finds them), so a 16 MB body of long strings costs little; chunk boundaries may fall anywhere,
inside a string or between a backslash and the byte it escapes.
"""

from __future__ import annotations

import re

# Deeper than any request a client sends (an OpenAI JSON schema allows 10 levels of objects,
# about 30 JSON levels), far below where a recursive walk runs out of stack (~500).
MAX_JSON_DEPTH = 128

_STRUCTURAL = re.compile(rb'[\[\]{}"\\]')
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = frozenset(b"[{"), frozenset(b"]}"), ord('"'), ord("\\")


class JsonDepthGauge:
    """Feed a body chunk by chunk; `too_deep` turns true once any point nests past the limit."""

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        self.limit = limit
        self.depth = 0
        self.too_deep = False
        self._in_string = False
        self._escaped = False  # the previous chunk ended on a backslash inside a string

    def feed(self, chunk: bytes) -> bool:
        """Whether the body so far stays within the limit."""
        skip = -1
        if self._escaped and chunk:
            skip, self._escaped = 0, False  # the escaped byte opens this chunk
        for match in _STRUCTURAL.finditer(chunk):
            at = match.start()
            if at == skip:
                continue
            self._step(chunk[at])
            if self._escaped and at + 1 < len(chunk):
                skip, self._escaped = at + 1, False
            if self.too_deep:
                return False
        return True

    def _step(self, byte: int) -> None:
        if self._in_string:
            if byte == _BACKSLASH:
                self._escaped = True
            elif byte == _QUOTE:
                self._in_string = False
        elif byte == _QUOTE:
            self._in_string = True
        elif byte in _OPEN:
            self.depth += 1
            self.too_deep = self.depth > self.limit
        elif byte in _CLOSE:
            self.depth -= 1
