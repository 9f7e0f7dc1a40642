"""Structured output through xgrammar (the grammar engine SGLang and vLLM use).

A request's grammar is compiled when the request is made: on the server in the compile pool's
processes (frontend/grammar_pool.py), offline in the calling thread; never on the engine thread.
A request carries it in xgrammar's serialised form, which each rank reads back. Each step, a
constrained row's logits keep only the tokens its grammar allows (after penalties and biases,
so the grammar has the last word); the sampled token then advances the row's matcher. A grammar
that completes ends its request with "stop". xgrammar is imported on the first constrained
request: a server that never sees one never loads it. A server's engine core imports it on a
thread of its own as the API process starts compiling the first one (`prepare`), so that the
step that adds the request does not stall every stream for the import.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierserve.errors import TierserveError
from tierserve.sampling_params import StructuredOutput

if TYPE_CHECKING:  # the API process compiles grammars; torch comes with xgrammar if it must
    import torch

# Compiled grammars kept for reuse across requests (xgrammar's cache, evicted by size).
CACHE_BYTES = 64 * 1024 * 1024
# What a grammar may be, checked before compiling: its source (a JSON schema's text, a regex, an
# EBNF) in characters, and the enum/const values a JSON schema lists (compile time grows with
# them: 100,000 took 87 s). Past these a request is a 400; within them, the server's compile
# time limit (--grammar-compile-timeout) bounds the rest.
MAX_GRAMMAR_CHARS = 4_000_000
MAX_SCHEMA_ENUM_VALUES = 10_000
MAX_SCHEMA_DEPTH = 128  # JSON levels, as a request body (server/guards.py)
# The kinds whose source is JSON holding schemas, all under the limits above: a structural tag
# holds one per tag, a tool family's (builtin_structural_tag) one per tool; outside them, a
# forced call's tool with 20,000 enum values compiled for 17-21 s.
JSON_KINDS = ("json_schema", "structural_tag", "builtin_structural_tag")
# The classes xgrammar (0.2.9) writes a JSON string's characters with, rewritten as JSON's own.
# A length-bounded string's lets raw control characters (U+0000-U+001F) in: JSON forbids them,
# and json.loads refuses the output. Every one of them lets UTF-16 surrogates (U+D800-U+DFFF) in
# as UTF-8 bytes (ED A0-BF xx), which no UTF-8 decoder takes: the text showed three U+FFFD for
# the one character the grammar counted, and a 16-character name came out as 18.
LOOSE_STRING_CHARS = (
    r"[^\"\\\r\n]",  # a schema's string with a maxLength
    r"[^\0-\x1f\"\\\r\n]",  # a schema's string without one (json_object's too)
)
JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: tuple[int, ...] = ()) -> None:
        import xgrammar

        self._matcher = matcher
        self.stop_ids = stop_ids
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
        self._refused |= not self.try_accept(token)

    def try_accept(self, token: int) -> bool:
        """Advance by a draft token if the grammar allows it (the state is unchanged if not);
        `rollback` undoes it once the draft is verified."""
        return self._matcher.accept_token(token)

    def rollback(self, tokens: int) -> None:
        if tokens:
            self._matcher.rollback(tokens)

    @property
    def ended(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing more may follow."""
        return self._refused or self._matcher.is_terminated()


class Grammars:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, compiler made on first use."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, stop_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler: Any = None
        self._info: Any = None
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None

    def compile(self, spec: StructuredOutput) -> str:
        """`spec` compiled here, in xgrammar's serialised form (what requests carry); a grammar
        past the limits or that does not compile is the user's error."""
        check_size(spec)
        return compile_spec(self._get_compiler(), spec).serialize_json()

    def matcher(self, serialised: str) -> GrammarState:
        """A fresh matcher for a compiled grammar (a few milliseconds to read it back)."""
        info = self.tokenizer_info()  # first: waits for prepare()'s import, never runs beside it
        import xgrammar

        compiled = xgrammar.CompiledGrammar.deserialize_json(serialised, info)
        return GrammarState(xgrammar.GrammarMatcher(compiled), self._vocab_size, self.stop_ids)

    def start(self, spec: StructuredOutput) -> GrammarState:
        return self.matcher(self.compile(spec))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a grammar's output, as xgrammar is told them."""
        return tuple(sorted(self._stop_ids))

    def prepare(self) -> None:
        """Import xgrammar and make its view of the tokenizer on a thread of its own (once):
        the engine loop would stall for them (~1 s here) at the first matcher, every stream
        with it. A matcher asked for meanwhile waits for the thread's lock."""
        with self._lock:
            if self._preparing is None:
                self._preparing = threading.Thread(
                    target=self._prepare_quietly, name="tierserve-grammars", daemon=True
                )
                self._preparing.start()

    def _prepare_quietly(self) -> None:
        # A failure here (a tokenizer that does not load) is the first matcher's to report.
        with contextlib.suppress(Exception):
            self._get_compiler()

    def tokenizer_info(self) -> Any:
        """xgrammar's view of the tokenizer, made once."""
        self._get_compiler()
        return self._info

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer(), self._vocab_size, self.stop_ids)
                self._info, self._compiler = info, new_compiler(info)
            return self._compiler


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of a Hugging Face tokenizer for a model of `vocab_size` logits."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )


def new_compiler(tokenizer_info: Any) -> Any:
    import xgrammar

    return xgrammar.GrammarCompiler(tokenizer_info, max_threads=1, cache_limit_bytes=CACHE_BYTES)


def check_size(spec: StructuredOutput) -> None:
    """Refuse, before compiling, a grammar past the documented limits (docs/server.md)."""
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        message = f"{spec.kind} of {len(spec.source):,} characters is over {MAX_GRAMMAR_CHARS:,}"
        raise TierserveError(message, spec.kind)
    if spec.kind not in JSON_KINDS:
        return
    try:
        schema = json.loads(spec.source)
    except RecursionError:
        raise TierserveError(f"{spec.kind} nests too deeply to read", spec.kind) from None
    except ValueError:
        return  # not JSON: the compile says so, with xgrammar's reason
    values, depth = _enum_values_and_depth(schema)
    if values > MAX_SCHEMA_ENUM_VALUES:
        message = f"{spec.kind} lists {values:,} enum values, over {MAX_SCHEMA_ENUM_VALUES:,}"
        raise TierserveError(message, spec.kind)
    if depth > MAX_SCHEMA_DEPTH:
        message = f"{spec.kind} nests {depth} levels deep, over {MAX_SCHEMA_DEPTH}"
        raise TierserveError(message, spec.kind)


def _enum_values_and_depth(schema: Any) -> tuple[int, int]:
    """How many enum and const values a schema lists anywhere, and how deeply its JSON nests
    (a loop: no depth can run it out of stack)."""
    count, deepest, todo = 0, 0, [(schema, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            enum = item.get("enum")
            count += (len(enum) if isinstance(enum, list) else 0) + ("const" in item)
            todo += ((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            todo += ((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth)
    return count, deepest


def compile_spec(compiler: Any, spec: StructuredOutput) -> Any:
    """`spec` compiled by an xgrammar GrammarCompiler; a grammar that does not compile is the
    user's error. The one compile path: in-process (`LLM`) and in the server's compile pool."""
    compile_by_kind = {
        "json_schema": lambda: compiler.compile_grammar(_json_schema_ebnf(spec.source)),
        "json_object": lambda: compiler.compile_grammar(_json_object_ebnf()),
        "regex": lambda: compiler.compile_regex(spec.source),
        "ebnf": lambda: compiler.compile_grammar(spec.source),
        "lark": lambda: compiler.compile_lark(spec.source),
        "structural_tag": lambda: compiler.compile_structural_tag(spec.source),
        "builtin_structural_tag": lambda: compiler.compile_structural_tag(_builtin(spec.source)),
    }
    try:
        compiled = compile_by_kind[spec.kind]()
    except (RuntimeError, ValueError) as err:  # xgrammar's parse errors
        message = f"{spec.kind} does not compile: {_reason(err)}"
        raise TierserveError(message, spec.kind) from None
    if not _allows_a_first_token(compiled):
        raise TierserveError(f"{spec.kind} matches no text: it allows no first token", spec.kind)
    return compiled


def _allows_a_first_token(compiled: Any) -> bool:
    """Whether a grammar that compiled can start (`root ::= root`, an empty character class
    cannot): one that cannot would leave a request nothing to sample."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _builtin(arguments: str) -> str:
    """xgrammar's structural tag for a model family's format, as JSON, from the keyword
    arguments of its `get_builtin_structural_tag` (a JSON object). Built where it compiles:
    xgrammar brings torch, which a server's API process does not load."""
    import xgrammar

    kwargs = json.loads(arguments)
    if not isinstance(kwargs, dict):
        raise ValueError("its source must be a JSON object of keyword arguments")
    try:
        return xgrammar.get_builtin_structural_tag(**kwargs).model_dump_json()
    except TypeError as err:  # an argument it does not take
        raise ValueError(str(err)) from None


def _reason(err: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(err).__name__


def _json_schema_ebnf(schema: str) -> str:
    """The schema's grammar, compact (no optional whitespace, which a small model can fill
    without end), its bounded strings as strict as JSON's."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return _strict_strings(str(grammar))


def _json_object_ebnf() -> str:
    """A JSON object, compact, as any JSON schema's grammar (OpenAI's json_object promises an
    object; vLLM compiles `{"type": "object"}`). xgrammar's builtin JSON grammar let arrays
    in and runs of whitespace anywhere: a small model wrote `[             1, 2, ...`."""
    return _json_schema_ebnf('{"type": "object"}')


def _strict_strings(ebnf: str) -> str:
    for loose in LOOSE_STRING_CHARS:
        ebnf = ebnf.replace(loose, JSON_STRING_CHAR)
    return ebnf
