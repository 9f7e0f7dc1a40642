"""The one exception type for user errors: bad arguments, bad requests, plans that do not fit."""

from __future__ import annotations


class TierserveError(ValueError):
    """A user error with a message that says what was wrong and what the limit is.

    `field` names the offending parameter (an engine flag, a sampling parameter) so that the
    HTTP server can report it as OpenAI's `param` and the CLI can exit with status 2.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class StorageFull(TierserveError):
    """A request the server cannot store what it must write for (its hidden states): 507."""
