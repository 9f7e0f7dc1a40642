"""How long a request waits for its prefix to come from storage
(`--hicache-storage-prefetch-policy`):

- auto (the default): as best_effort, and also, idle engine or not, until the prefetch ends when
  reading its pages is estimated to take less than recomputing them; never longer than the
  recompute estimate. A lone request after a restart so finds what the store holds.
- best_effort (SGLang's meaning): while the engine has other requests to run; an idle engine
  admits it at once;
- wait_complete: until the prefetch ends (found all, hit a miss, or the store failed);
- timeout: until it ends or `base + per_ki_token × tokens / 1024` seconds pass (capped).

auto's estimates come from measured rates: the store's bytes per second over this process's
reads, and the engine's prefill tokens per second over its prefill steps. Before a read is
measured, reading is assumed to win (the wait is still bounded by the recompute estimate); before
a prefill is measured, recomputing is estimated from the model's FLOPs per token at a device rate
below what current devices sustain, so the bound errs long rather than short. Either rate can be
pinned in the extra config (`prefetch_read_bytes_per_s`, `prefetch_recompute_tokens_per_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")
DEFAULT_POLICY = "auto"
# FLOP/s assumed before the engine has measured a prefill: well under what the device class
# sustains, so the first recompute estimate is long.
PRIOR_FLOPS = {"cpu": 1e10, "cuda": 1e14}
SMOOTHING = 0.3  # weight of the newest sample in a measured rate


@dataclass
class MeasuredRate:
    """Units per second, smoothed over samples; `pinned` (when > 0) wins over measurement and
    `prior` stands in until the first sample."""

    prior: float | None = None
    pinned: float = 0.0
    measured: float | None = None

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        rate = units / seconds
        old = self.measured
        self.measured = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    @property
    def value(self) -> float | None:
        if self.pinned > 0:
            return self.pinned
        return self.measured if self.measured is not None else self.prior


@dataclass
class PrefetchRates:
    """What auto weighs: the store's read rate (bytes/s) against the engine's prefill rate
    (tokens/s)."""

    read: MeasuredRate
    recompute: MeasuredRate

    @classmethod
    def make(
        cls, pinned_read: float, pinned_recompute: float, flops_per_token: float, device: str
    ) -> PrefetchRates:
        prior_flops = PRIOR_FLOPS.get(device, PRIOR_FLOPS["cuda"])
        prior = prior_flops / flops_per_token if flops_per_token > 0 else None
        return cls(MeasuredRate(pinned=pinned_read), MeasuredRate(prior, pinned_recompute))

    def observe_step(self, chunk_tokens: list[int], seconds: float) -> None:
        """A step's chunks (tokens each) and its time: a step that is mostly prefill measures
        the recompute rate (decode rows cost more per token than prefill)."""
        prefill = sum(n for n in chunk_tokens if n > 1)
        if prefill * 4 >= sum(chunk_tokens) * 3:
            self.recompute.observe(sum(chunk_tokens), seconds)

    def recompute_seconds(self, tokens: int) -> float:
        rate = self.recompute.value
        return tokens / rate if rate else 0.0

    def read_seconds(self, nbytes: int) -> float | None:
        """None before any read was measured (and none pinned)."""
        rate = self.read.value
        return nbytes / rate if rate else None

    def wait_limit(self, tokens: int, nbytes: int) -> float:
        """auto: seconds a request may wait for `nbytes` that would otherwise be `tokens`
        recomputed; 0 when reading them is estimated to be the slower way."""
        recompute = self.recompute_seconds(tokens)
        read = self.read_seconds(nbytes)
        return recompute if read is None or read < recompute else 0.0


def should_wait(policy: str, busy: bool, expired: bool) -> bool:
    """Whether a request whose prefetch has not ended stays out of the batch; `expired`: the
    policy's wait has run out (auto, timeout)."""
    if policy == "best_effort":
        return busy
    if policy == "auto":
        return busy or not expired
    return policy == "wait_complete" or not expired
