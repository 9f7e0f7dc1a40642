"""What the scheduler asks of a proposer, and what a proposer reads of a request."""

from __future__ import annotations

from typing import Protocol


class DraftSource(Protocol):
    """A request as proposers see it (the engine's Request)."""

    next_draft: tuple[int, ...]  # what a draft model proposed after its last step

    def last_ids(self, n: int) -> list[int]: ...


class Proposer(Protocol):
    # Slots past a sampling chunk's rows that proposing writes (a draft model's later steps).
    lookahead: int

    def draft_for(self, req: DraftSource, k: int) -> tuple[int, ...]:
        """Up to `k` tokens to verify after `req`'s last one."""
        ...
