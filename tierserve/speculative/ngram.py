"""NGRAM drafts (prompt lookup): the tokens that followed the last place where the request's
own text ended as it ends now. Free to propose, and strong where outputs copy their input
(code edits, extraction, summaries quoting the source); nothing is proposed where no suffix
recurs, and such a request decodes one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tierserve.args import EngineArgs

if TYPE_CHECKING:
    from tierserve.speculative.proposer import DraftSource


@dataclass(frozen=True)
class NgramProposer:
    min_window: int  # the shortest suffix looked up
    max_window: int  # the longest; the longest suffix that recurs wins
    # Only the last `search_tokens` of a sequence are searched: a step's proposals for 64
    # requests of 100K tokens each must not cost more than the step.
    search_tokens: int = 4096
    lookahead = 0  # slots past a chunk's rows it writes: none, it runs no model

    def draft_for(self, req: DraftSource, k: int) -> tuple[int, ...]:
        return self.propose(req.last_ids(self.search_tokens), k)

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (between min_window and max_window long)."""
        if k <= 0 or len(tokens) < self.min_window + 1:
            return ()
        seq = np.asarray(tokens[-self.search_tokens :], dtype=np.int64)
        n_seq = len(seq)
        for n in range(min(self.max_window, n_seq - 1), self.min_window - 1, -1):
            suffix = seq[n_seq - n :]
            # Windows that start before the suffix itself and are followed by a token.
            windows = sliding_window_view(seq[: n_seq - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tuple(seq[start : start + k].tolist())
        return ()


def proposer_for(args: EngineArgs) -> NgramProposer | None:
    """The proposer the flags ask for; None without speculation."""
    if args.speculative_algorithm != "NGRAM":
        return None
    lo = args.speculative_ngram_min_match_window_size
    return NgramProposer(lo, args.speculative_ngram_max_match_window_size)
