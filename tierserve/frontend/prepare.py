"""From a prompt as a user sends it to the message that adds it to the engine: tokenize,
fill in max_tokens, validate against the context and the KV pool, compile a grammar.

It touches no scheduler state: the server runs it in the API process (its threads), the
offline `LLM` in the caller's, and both reach the engine with the same `AddRequest`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

from tierserve.core_messages import AddRequest, CoreInfo
from tierserve.errors import StorageFull, TierserveError
from tierserve.frontend.grammar import Grammars
from tierserve.sampling_params import SamplingParams, encodes_utf8
from tierserve.sizing import pages_for
from tierserve.utils import format_bytes

# A token is rarely longer than this many characters: text longer than the context times this
# is refused before it is tokenized (a 10 MB prompt took ~10 s and gigabytes to learn that).
MAX_CHARS_PER_TOKEN = 32


class RequestPreparer:
    def __init__(self, info: CoreInfo, tokenizer: Callable[[], Any]) -> None:
        """`tokenizer()` gives the tokenizer (an engine core loads it only if text comes)."""
        self.info = info
        self._tokenizer = tokenizer
        self.context_length = info.context_length
        self.grammars = Grammars(tokenizer, info.vocab_size, set(info.eos_token_ids))
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def next_arrival(self) -> int:
        """A place in line, taken when a request arrives: a long prompt still being tokenized
        keeps its place ahead of a short one that came after it."""
        return next(self._arrivals)

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None,
        arrival: int,
        grammar: str | None = None,
    ) -> AddRequest:
        """Tokenize and validate into the message that adds a request. A structured output is
        compiled here unless the server's compile pool already has (`grammar`)."""
        prompt_ids = self._encode(prompt, self._kept_tokens(params))
        if params.max_tokens is None:
            room = self._room_after(prompt_ids)
            if params.min_tokens > room:  # named as sent, not as the max_tokens filled in
                message = (
                    f"min_tokens {params.min_tokens} > the {room} tokens the prompt "
                    f"({len(prompt_ids)} tokens) leaves within the context length "
                    f"{self.context_length} (KV pool {self._pool_tokens} tokens)"
                )
                raise TierserveError(message, field="min_tokens")
            params = dataclasses.replace(params, max_tokens=room)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_ids(params))
        self._validate(prompt_ids, params)
        if params.return_hidden_states is not False:  # a request that writes no file needs no room
            self._check_hidden_states_room(len(prompt_ids))
        if params.structured_output is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_output)
        rid = request_id or f"req-{next(self._ids)}"
        # A truncated prompt is no longer its text: an echo decodes the ids it ran on.
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        return AddRequest(rid, arrival, prompt_ids, params, text, grammar)

    def _check_allowed(self, params: SamplingParams) -> None:
        allowed = params.allowed_token_ids
        if allowed is None:
            return
        vocab = self.info.vocab_size
        if len(allowed) > vocab or any(t >= vocab for t in allowed):
            message = f"allowed_token_ids must be token ids in [0, {vocab})"
            raise TierserveError(message, "allowed_token_ids")
        stops = {*params.stop_token_ids, *(() if params.ignore_eos else self.info.eos_token_ids)}
        if params.min_tokens and stops.issuperset(allowed):  # min_tokens bans each of them
            message = "min_tokens can never be met: allowed_token_ids holds only stop tokens"
            raise TierserveError(message, "allowed_token_ids")

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """vLLM's reading of bad_words: each word's tokens as the text's start, and after a
        space where that form starts with another token and is as long (a word of its own
        there, not a piece of the one before); a word without tokens is refused."""
        tokenizer = self._tokenizer()
        seqs: list[tuple[int, ...]] = []
        for word in params.bad_words or ():
            plain = tuple(tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
            if not plain:
                message = f"bad word {word!r} is no token of this tokenizer"
                raise TierserveError(message, "bad_words")
            seqs.append(plain)
            spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        return tuple(seqs)  # bounded by SamplingParams: replace() validates them again

    def check_text_length(self, chars: int, field: str) -> None:
        """Refuse text no context could hold before tokenizing it."""
        limit = self.context_length * MAX_CHARS_PER_TOKEN
        if chars > limit:
            raise TierserveError(
                f"{field} of {chars:,} characters cannot fit in the context of "
                f"{self.context_length:,} tokens (at most {limit:,} characters are read)",
                field=field,
            )

    def _kept_tokens(self, params: SamplingParams) -> int | None:
        """vLLM's truncate_prompt_tokens as a count: -1 keeps what the context holds beside the
        tokens to generate (max_tokens, or one), so that the request always runs."""
        keep = params.truncate_prompt_tokens
        if keep != -1:
            return keep
        room = min(self.context_length, self._pool_tokens)  # as _room_after counts it
        return max(1, room - (params.max_tokens or 1))

    def _encode(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        """The prompt's ids; with `keep` (vLLM's truncate_prompt_tokens), its last ones."""
        if isinstance(prompt, str) and keep is not None:
            # Only the text's end is read: past `keep` tokens' worth of characters (and a
            # margin for the cut's effect on the first tokens) it could only be dropped.
            prompt = prompt[-(keep + 64) * MAX_CHARS_PER_TOKEN :]
        ids = self._ids_of(prompt, bounded=keep is None)
        return ids if keep is None else ids[-keep:]

    def _ids_of(self, prompt: str | list[int], bounded: bool) -> list[int]:
        """`bounded`: text no context could hold is refused before it is tokenized."""
        if isinstance(prompt, str):
            if not prompt:
                raise TierserveError("prompt is empty", field="prompt")
            if bounded:
                self.check_text_length(len(prompt), "prompt")
            try:
                ids = self._tokenizer()(prompt).input_ids
            except TypeError:  # what tokenizers says of a lone UTF-16 surrogate ("\ud800")
                if not encodes_utf8(prompt):
                    message = "prompt holds a lone UTF-16 surrogate, which UTF-8 cannot encode"
                    raise TierserveError(message, field="prompt") from None
                raise
            return self._in_vocab(ids)
        ids = list(prompt)
        vocab = self.info.vocab_size
        if not ids:
            raise TierserveError("prompt is empty", field="prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise TierserveError(f"prompt token ids must be ints in [0, {vocab})", field="prompt")
        return ids

    def _in_vocab(self, ids: list[int]) -> list[int]:
        """A tokenizer's ids, refused where one is past the model's embedding (a tokenizer of
        another model): the step that embedded it failed, and the server with it."""
        vocab = self.info.vocab_size
        if ids and max(ids) >= vocab:
            message = (
                f"the tokenizer gave token id {max(ids)}, past the model's vocab_size of {vocab}:"
                " is --tokenizer this model's?"
            )
            raise TierserveError(message, field="prompt")
        return ids

    @property
    def _pool_tokens(self) -> int:
        return self.info.num_pages * self.info.page_size

    def _room_after(self, prompt_ids: list[int]) -> int:
        """Tokens a request may generate when it does not say: up to the context or pool end."""
        room = min(self.context_length, self._pool_tokens) - len(prompt_ids)
        if room <= 0:
            raise TierserveError(
                f"prompt ({len(prompt_ids)} tokens) leaves no room to generate within the context"
                f" length {self.context_length} (KV pool {self._pool_tokens} tokens)",
                field="prompt",
            )
        return room

    def _check_hidden_states_room(self, tokens: int) -> None:
        """A server that writes every request's hidden states refuses (507) a request whose
        file the directory cannot take, before it runs."""
        directory = self.info.hidden_states_dir
        if directory is None:
            return
        need = tokens * self.info.hidden_state_bytes_per_token
        try:
            writable = os.path.isdir(directory) and os.access(directory, os.W_OK)
            fs = os.statvfs(directory) if writable else None  # its free bytes and inodes
        except OSError:
            writable, fs = False, None
        if not writable or fs is None:
            message = f"the hidden-states directory {directory} is not a writable directory"
            raise StorageFull(message, "hidden_states_dir")
        free = fs.f_bavail * fs.f_frsize  # what shutil.disk_usage calls free
        # A file, its lock and its temporary name; f_files 0: the filesystem counts no inodes.
        if fs.f_files and fs.f_favail < 3:
            message = f"the hidden-states directory {directory} has no free inodes left"
            raise StorageFull(message, "hidden_states_dir")
        if free < need:
            message = (
                f"the hidden-states directory {directory} has {format_bytes(free)} free; this "
                f"request's hidden states need {format_bytes(need)}"
            )
            raise StorageFull(message, "hidden_states_dir")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.info.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise TierserveError(f"logit_bias token ids must be < {vocab}", "logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            # An id past the logits can never stop a request, and min_tokens bans each by index.
            message = f"stop_token_ids must be token ids in [0, {vocab})"
            raise TierserveError(message, "stop_token_ids")
        self._check_allowed(params)
        if any(t >= vocab for seq in params.bad_words_token_ids or () for t in seq):
            message = f"bad_words must be tokens of this model's vocabulary of {vocab}"
            raise TierserveError(message, "bad_words")
        assert params.max_tokens is not None  # filled in by prepare() before this check
        total = len(prompt_ids) + params.max_tokens
        if total > self.context_length:
            raise TierserveError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
                f" exceeds the context length {self.context_length}",
                field="max_tokens",
            )
        if pages_for(total, self.info.page_size) > self.info.num_pages:
            raise TierserveError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
                f" exceeds the KV pool of {self._pool_tokens} tokens",
                field="max_tokens",
            )
