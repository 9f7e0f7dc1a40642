"""The front end's side of a request: from the engine's token ids to the text a user sees.

Detokenization and stop strings run here, outside the engine step (the server calls this on its
event loop, `LLM` between steps), so the engine's work per token is O(1) whatever a request
asks. The work here is bounded per token too: one incremental decode, and a stop search over
the new text plus the longest stop string's length (text that may begin a stop string is held
back until it cannot).

A stop string is seen here, after the engine has sampled the token: the caller aborts the
request in the engine (`stopped_here`), and tokens the engine made before the abort landed are
dropped, so outputs are the same as if the engine had stopped at once.
"""

from __future__ import annotations

from typing import Any, Protocol

from tierserve.outputs import RequestOutput, StepOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams


class Submitted(Protocol):
    """What a request carries into its outputs: the API process's `AddRequest`, or the offline
    engine's own request."""

    @property
    def rid(self) -> str: ...
    @property
    def prompt_text(self) -> str | None: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def params(self) -> SamplingParams: ...


class OutputBuilder:
    """One request's outputs, built from the engine's StepOutputs as they arrive."""

    def __init__(
        self, req: Submitted, tokenizer: Any, eos_ids: frozenset[int] = frozenset()
    ) -> None:
        """`eos_ids`: the model's EOS tokens, which end a request without a stop_reason (as in
        vLLM) unless it ignores EOS."""
        self.request_id = req.rid
        self.prompt, self.prompt_ids = req.prompt_text, req.prompt_ids
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.hidden_states_path: str | None = None
        self.stops = req.params.stop
        self._stop_ids = frozenset(req.params.stop_token_ids)
        self._eos_ids = frozenset() if req.params.ignore_eos else eos_ids
        self._include_stop = req.params.include_stop_str_in_output
        # As vLLM: a stop string ends a request only in text its first min_tokens did not make.
        self.min_tokens = req.params.min_tokens
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._detokenizer = IncrementalDetokenizer(tokenizer, req.params.skip_special_tokens)
        # The token that ends the request, EOS or one of stop_token_ids, is left out of the
        # text, as in vLLM: a special token's text is kept otherwise only when asked for.
        self._stop_tokens = self._stop_ids | (
            frozenset() if req.params.skip_special_tokens else frozenset(tokenizer.all_special_ids)
        )
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._parts: list[str] = []  # text already released
        self._held = ""  # settled text not released yet: it may begin a stop string
        self._unchecked = 0  # chars the held text starts with that the first min_tokens made
        self.finished = False
        self.stopped_here = False  # a stop string ended it: the engine still has to be told

    def add(self, step: StepOutput) -> RequestOutput | None:
        """The output for one engine step, or None for a token sampled after the request
        already finished here (the engine had not seen the abort yet)."""
        if self.finished:
            return None
        first = not self._ids
        self._ids.append(step.token_id)
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = list(step.prompt_logprobs)
        if step.hidden_states_path is not None:
            self.hidden_states_path = step.hidden_states_path
        new_logprobs = [step.logprob] if step.logprob is not None else []
        self._logprobs += new_logprobs
        stopped = step.finish_reason == "stop"
        ends = stopped and step.token_id in self._stop_tokens and not self._include_stop
        text = "" if ends else self._detokenizer.add(step.token_id)
        if step.finished:
            text += self._detokenizer.flush()
        reason = step.finish_reason
        stop_reason: int | str | None = (
            step.token_id
            if stopped and step.token_id in self._stop_ids and step.token_id not in self._eos_ids
            else None
        )
        window = self._held + text
        checks = bool(text and self.stops) and len(self._ids) > self.min_tokens
        hit = self._first_stop(window, self._unchecked) if checks else None
        if hit is not None:
            start, stop_reason = hit
            window = window[: start + len(stop_reason) if self._include_stop else start]
            reason = "stop"
            self.stopped_here = not step.finished
        split = len(window) if reason else max(0, len(window) - self._hold)
        delta, self._held = window[:split], window[split:]
        if len(self._ids) <= self.min_tokens:
            self._unchecked = len(self._held)
        else:
            self._unchecked = max(0, self._unchecked - split)
        self._parts.append(delta)
        self.finished = reason is not None
        carries_prompt = first or self.finished
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[step.token_id],
            text_delta=delta,
            num_output_tokens=len(self._ids),
            finished=self.finished,
            finish_reason=reason,
            stop_reason=stop_reason if reason == "stop" else None,
            prompt_tokens=step.prompt_tokens,
            cached_tokens=step.cached_tokens,
            num_preemptions=step.num_preemptions,
            token_ids=self._ids if self.finished else [],
            text="".join(self._parts) if self.finished else "",
            new_logprobs=new_logprobs,
            logprobs=self._logprobs if self.finished else [],
            prompt=self.prompt if carries_prompt else None,
            prompt_token_ids=self.prompt_ids if carries_prompt else [],
            prompt_logprobs=self.prompt_logprobs if carries_prompt else None,
            hidden_states_path=self.hidden_states_path if carries_prompt else None,
            spec_verify_ct=step.spec_verify_ct,
        )

    def _first_stop(self, window: str, unchecked: int) -> tuple[int, str] | None:
        """Where the stop string that ends first in the window starts (the first listed of
        those that end together), and it, of those that end past its first `unchecked` chars:
        text the first min_tokens tokens made ends no request. The window is the held text plus
        the new text, so this is bounded by the stop list, not by the output's length."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = window.find(stop, max(0, unchecked - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        return (best[1], best[2]) if best else None


# --- incremental detokenization -------------------------------------------------------
#
# Incremental detokenization, O(1) work per token.
#
# A byte-level token can end mid-character; text is released only once its bytes complete a
# character, so no piece shows half a character as U+FFFD. With a fast tokenizer, tokenizers'
# `DecodeStream` keeps that state in Rust; otherwise a window of the unsettled ids is decoded
# (the prefix/read-offset method of vLLM and TGI). Either way the unsettled window is bounded: after
# MAX_UNSETTLED ids that never completed a character (a model emitting stray bytes), they are
# released as U+FFFD and decoding restarts, so one odd request cannot make each step slower.

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
