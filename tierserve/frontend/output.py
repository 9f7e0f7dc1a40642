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

from tierserve.frontend.detokenizer import IncrementalDetokenizer
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
