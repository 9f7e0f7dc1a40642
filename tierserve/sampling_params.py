"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from tierserve.errors import TierserveError

GREEDY_BELOW = 1e-5
# Per-request list limits, so one request cannot make every step slow for all (stop strings are
# matched on each new token). OpenAI allows 4 stop strings; vLLM and SGLang set no bound.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # past the largest vocabularies (~256K); prepare.py: ≤ vocab
# vLLM's bounds on bad_words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): token
# sequences after tokenization, and their tokens in all; the words themselves as stop strings.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
MAX_SAMPLES = 128  # n: bounded work per prompt (the server's bound on a request's choices)
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


STRUCTURED_KINDS = (
    "json_schema", "json_object", "regex", "ebnf", "lark", "structural_tag",
    "builtin_structural_tag",
)  # fmt: skip


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow: OpenAI's json_schema and json_object, SGLang's regex
    and ebnf, a Lark grammar (vLLM's structured_outputs.grammar takes either), xgrammar's
    structural tags. `source` is the schema as JSON text, the regex, the EBNF or Lark grammar
    ("" for json_object), the structural tag as JSON, or for builtin_structural_tag the
    keyword arguments of xgrammar's `get_builtin_structural_tag` as a JSON object (a model
    family's tool-call format: server/tools.py), which the compile expands."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise TierserveError(f"structured output must be one of {STRUCTURED_KINDS}", "kind")
        if not isinstance(self.source, str) or (not self.source and self.kind != "json_object"):
            raise TierserveError(f"{self.kind} must be a non-empty string", self.kind)

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True)
class SamplingParams:
    """What and how much to generate. temperature 0 means greedy."""

    max_tokens: int | None = 16  # None: as many as the context (and KV pool) leave room for
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # OpenAI's penalties on generated tokens: logit -= count × frequency + (count > 0) × presence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and SGLang's extras: HF's repetition penalty over prompt and output (a positive
    # logit ÷ it, a negative × it); no stop token before `min_tokens` generated tokens.
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # Per generated token: its log-probability and the `logprobs` most likely alternatives',
    # from the model's raw distribution (before penalties and temperature, vLLM's default).
    logprobs: int | None = None
    # Per prompt token after the first: its log-probability and the top alternatives' (vLLM's
    # name). A cached prefix has no logits, so such a request computes its whole prompt.
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # On a server with --hidden-states-dir (SGLang's name): None captures, as the server does
    # for every request (vLLM's way); False opts this request out.
    return_hidden_states: bool | None = None
    # vLLM's: special tokens left out of the text. A tool-call parser whose format is written
    # in special tokens (Kimi's, DeepSeek's) turns it off for its requests; the stop token
    # that ends a request is never text.
    skip_special_tokens: bool = True
    # vLLM's: the stop string, or the stop token's text, that ended the request kept in it.
    include_stop_str_in_output: bool = False
    # vLLM's: only these tokens may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: the prompt's last k tokens only (-1: as many as the context holds); None: all.
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never generated. The engine tokenizes each, as the text's start and after a
    # space, into `bad_words_token_ids` (frontend/prepare.py); the sampler bans a sequence's last
    # token wherever the output ends with the tokens before it.
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Samples of the prompt (vLLM's offline `n`: LLM.generate runs each as a request of its
    # own, `sample(i)`; the server's `n` is the request body's).
    n: int = 1

    def __post_init__(self) -> None:
        # Accept lists and a single string the way OpenAI clients send them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.allowed_token_ids, list | tuple):  # each once, in order
            object.__setattr__(
                self, "allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids))
            )
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        words = self.bad_words
        if isinstance(words, list | tuple) and all(isinstance(w, str) for w in words):
            object.__setattr__(self, "bad_words", tuple(dict.fromkeys(words)))  # each once
        seqs = self.bad_words_token_ids
        if isinstance(seqs, list | tuple) and all(isinstance(s, list | tuple) for s in seqs):
            object.__setattr__(self, "bad_words_token_ids", tuple(map(tuple, seqs)))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or ()
            if not isinstance(value, list | tuple):
                raise TierserveError(f"{name} must be a list, got {value!r}", name)
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        self._validate()
        self._validate_penalties()

    def _validate(self) -> None:
        self._check_types()
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise TierserveError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise TierserveError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise TierserveError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not -1 <= self.top_k < 2**31:  # any k past the vocabulary keeps every token
            message = f"top_k must be -1 (off) or in [0, 2**31), got {self.top_k}"
            raise TierserveError(message, "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise TierserveError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not s for s in self.stop):
            raise TierserveError("stop strings must be non-empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise TierserveError(
                f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters",
                "stop",
            )
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise TierserveError("stop_token_ids must be integers", "stop_token_ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise TierserveError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                "stop_token_ids",
            )
        structured = self.structured_output
        if structured is not None and not isinstance(structured, StructuredOutput):
            raise TierserveError("structured_output must be a StructuredOutput", "kind")
        self._validate_vllm_extras()
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise TierserveError(f"seed must be in [0, 2**63), got {self.seed}", "seed")

    def _validate_vllm_extras(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, tuple) or not allowed:
                raise TierserveError(
                    "allowed_token_ids must be a non-empty list", "allowed_token_ids"
                )
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed):
                raise TierserveError("allowed_token_ids must be token ids", "allowed_token_ids")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                message = f"at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids"
                raise TierserveError(message, "allowed_token_ids")
            if self.structured_output is not None:  # the two masks could leave no token
                message = "allowed_token_ids with a structured output is not supported"
                raise TierserveError(message, "allowed_token_ids")
        self._validate_bad_words()
        if not 1 <= self.n <= MAX_SAMPLES:
            raise TierserveError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}", "n")
        k = self.truncate_prompt_tokens
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)
        ):
            message = f"truncate_prompt_tokens must be >= 1 or -1, got {k!r}"
            raise TierserveError(message, "truncate_prompt_tokens")

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if words is not None:
            if not isinstance(words, tuple) or not all(isinstance(w, str) for w in words):
                raise TierserveError("bad_words must be a list of strings", "bad_words")
            if any(not w.strip() for w in words):
                raise TierserveError("bad_words cannot hold an empty or blank word", "bad_words")
            if not all(w.isascii() or encodes_utf8(w) for w in words):
                message = "bad_words hold a lone UTF-16 surrogate, which UTF-8 cannot encode"
                raise TierserveError(message, "bad_words")
            if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_CHARS for w in words):
                message = f"at most {MAX_BAD_WORDS} bad_words of {MAX_STOP_CHARS} characters each"
                raise TierserveError(message, "bad_words")
        seqs = self.bad_words_token_ids
        if seqs is None:
            return
        ok = isinstance(seqs, tuple) and all(
            isinstance(s, tuple)
            and s
            and all(not isinstance(t, bool) and isinstance(t, int) and t >= 0 for t in s)
            for s in seqs
        )
        if not ok:
            message = "bad_words_token_ids must be non-empty lists of token ids"
            raise TierserveError(message, "bad_words")
        if len(seqs) > MAX_BAD_WORDS or sum(map(len, seqs)) > MAX_BAD_WORDS_TOKENS:
            message = (
                f"bad_words make {len(seqs)} token sequences of {sum(map(len, seqs))} tokens; "
                f"at most {MAX_BAD_WORDS} of {MAX_BAD_WORDS_TOKENS} in all"
            )
            raise TierserveError(message, "bad_words")

    def _check_types(self) -> None:
        """Wrong types and NaN fail here, with the field's name, not deep inside a batch."""
        ints = {"top_k": self.top_k, "max_tokens": self.max_tokens, "seed": self.seed, "n": self.n}
        for name, value in ints.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TierserveError(f"{name} must be an integer, got {value!r}", name)
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TierserveError(f"{name} must be a number, got {value!r}", name)
            if not math.isfinite(value):
                raise TierserveError(f"{name} must be finite, got {value}", name)
        switches = {
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        if self.return_hidden_states is not None:
            switches["return_hidden_states"] = self.return_hidden_states
        for name, value in switches.items():
            if not isinstance(value, bool):  # "yes" would be true, and "false" too
                raise TierserveError(f"{name} must be true or false, got {value!r}", name)
        if not all(isinstance(s, str) for s in self.stop):
            raise TierserveError("stop must be a string or a list of strings", "stop")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise TierserveError("stop_token_ids must be integers", "stop_token_ids")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TierserveError(f"{name} must be a number, got {value!r}", name)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # OpenAI's range; also refuses NaN
                raise TierserveError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            message = f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            raise TierserveError(message, "repetition_penalty")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise TierserveError(
                f"min_tokens must be an integer, got {self.min_tokens!r}", "min_tokens"
            )
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise TierserveError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise TierserveError(f"{name} must be in [0, {MAX_LOGPROBS}]", name)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise TierserveError(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
        for pair in self.logit_bias:
            ok = (
                len(pair) == 2
                and isinstance(pair[1], int | float)
                and not isinstance(pair[1], bool)
            )
            if not ok or not isinstance(pair[0], int) or pair[0] < 0 or not -100 <= pair[1] <= 100:
                raise TierserveError(
                    "logit_bias maps token ids to numbers in [-100, 100]", "logit_bias"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must look at this request's history (penalties, biases) or its
        grammar."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.structured_output
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
        )

    def sample(self, i: int) -> SamplingParams:
        """Sample `i` of the n these params ask for, as a request of its own: with a seed, seed
        + i (within [0, 2**63): a seed near its top was refused as one the caller never
        sent); only the first scores the prompt (the others start from its cached prefix)."""
        seed = None if self.seed is None else (self.seed + i) % 2**63
        logprobs = self.prompt_logprobs if i == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=logprobs)

    @property
    def greedy(self) -> bool:
        # Below this temperature float32 logits / temperature overflow: sample as greedy.
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from OpenAI's form, {"token id": bias}, or pairs already."""
    if isinstance(bias, dict):
        pairs = sorted(((_token_id(k), v) for k, v in bias.items()), key=lambda p: p[0])
        ids = [t for t, _ in pairs]
        if len(set(ids)) < len(ids):  # "100" and "0100": one would silently win
            raise TierserveError("logit_bias names a token id twice", "logit_bias")
        return tuple(pairs)
    if not isinstance(bias, list | tuple) or not all(isinstance(p, list | tuple) for p in bias):
        raise TierserveError("logit_bias maps token ids to numbers in [-100, 100]", "logit_bias")
    return tuple(tuple(pair) for pair in bias)


def _token_id(key: object) -> int:
    """A logit_bias key: OpenAI sends token ids as JSON object keys, so as strings of digits
    (int() also read "1_0" as 10, " 7 " as 7 and 5.7 as 5)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    raise TierserveError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")


def encodes_utf8(text: str) -> bool:
    """Whether UTF-8 can encode `text`: not with a lone UTF-16 surrogate ("\\ud800"), which a
    JSON body can carry and no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
