"""Speculative decoding: proposers that draft tokens (ngram.py: prompt lookup; draft_model.py:
a draft model's steps, EAGLE-3's or an MTP layer's) and the verifier that keeps what one target
forward confirms (verifier.py). Above models (a draft is a model), below the engine, whose
scheduler asks for drafts and whose runner verifies them."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.speculative.draft_model import DraftModelProposer, DraftRows
    from tierserve.speculative.ngram import NgramProposer, proposer_for
    from tierserve.speculative.proposer import DraftModel, Proposer
    from tierserve.speculative.verifier import SpecStats, verify

EXPORTS = {
    "DraftModel": "proposer",
    "DraftModelProposer": "draft_model",
    "DraftRows": "draft_model",
    "NgramProposer": "ngram",
    "Proposer": "proposer",
    "SpecStats": "verifier",
    "proposer_for": "ngram",
    "verify": "verifier",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
