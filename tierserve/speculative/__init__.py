"""Speculative decoding: proposers that draft tokens (ngram.py: prompt lookup; draft_model.py:
a draft model's steps, EAGLE-3's or an MTP layer's) and the verifier that keeps what one target
forward confirms (verifier.py). Above models (a draft is a model), below the engine, whose
scheduler asks for drafts and whose runner verifies them."""

from tierserve.lazy import lazy_exports

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
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
