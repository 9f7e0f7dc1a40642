"""Structured output through xgrammar (the grammar engine SGLang and vLLM use).

A request's grammar is compiled when the request is made: in a worker thread on the server,
never on the engine thread, and cached by xgrammar per source. Each step, a constrained row's
logits keep only the tokens its grammar allows (after penalties and biases, so the grammar has
the last word); the sampled token then advances the row's matcher. A grammar that completes
ends its request with "stop". xgrammar is imported on the first constrained request: a server
that never sees one never loads it.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from tierserve.errors import TierserveError
from tierserve.sampling_params import StructuredOutput

# Compiled grammars kept for reuse across requests (xgrammar's cache, evicted by size).
CACHE_BYTES = 64 * 1024 * 1024
# xgrammar (0.2.9) writes the characters of a length-bounded JSON string as [^"\\\r\n],
# which lets raw control characters (U+0000-U+001F) in: JSON forbids them, and json.loads
# refuses the output. Its unbounded strings exclude them; bounded ones are rewritten to match.
LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = matcher
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._apply = xgrammar.apply_token_bitmask_inplace
        self._refused = False

    def mask(self, row: torch.Tensor) -> None:
        """In place: -inf for every token the grammar does not allow next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask.to(row.device, non_blocking=True)
        self._apply(row[None], bitmask)

    def accept(self, token: int) -> None:
        # Masked sampling only picks allowed tokens; a refusal would be a bug, and ends the
        # request rather than letting it run on outside its grammar.
        self._refused |= not self._matcher.accept_token(token)

    @property
    def ended(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing more may follow."""
        return self._refused or self._matcher.is_terminated()


class Grammars:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, compiler made on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler: Any = None
        self._lock = threading.Lock()

    def start(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for `spec`; a grammar that does not compile is the user's error."""
        import xgrammar

        compiler = self._get_compiler()
        compile_by_kind = {
            "json_schema": lambda: compiler.compile_grammar(_json_schema_ebnf(spec.source)),
            "json_object": compiler.compile_builtin_json_grammar,
            "regex": lambda: compiler.compile_regex(spec.source),
            "ebnf": lambda: compiler.compile_grammar(spec.source),
        }
        try:
            compiled = compile_by_kind[spec.kind]()
        except (RuntimeError, ValueError) as err:  # xgrammar's parse errors
            message = f"{spec.kind} does not compile: {_reason(err)}"
            raise TierserveError(message, spec.kind) from None
        return GrammarState(xgrammar.GrammarMatcher(compiled), self._vocab_size)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=sorted(self._stop_ids),
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=CACHE_BYTES
                )
            return self._compiler


def _reason(err: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(err).__name__


def _json_schema_ebnf(schema: str) -> str:
    """The schema's grammar, compact (no optional whitespace, which a small model can fill
    without end), its bounded strings as strict as JSON's."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return str(grammar).replace(LOOSE_STRING_CHAR, JSON_STRING_CHAR)
