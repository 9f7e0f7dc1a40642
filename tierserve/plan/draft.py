"""The draft model a speculative command line names, sized (sizing/draft.py says what is
counted): an EAGLE-3 draft by its safetensors, an MTP layer from config.json."""

from __future__ import annotations

from pathlib import Path

from tierserve.args import SPEC_STEPS, check_speculative_steps
from tierserve.errors import TierserveError
from tierserve.plan.weights import ModelSpec
from tierserve.sizing import DraftSize


def draft_size(
    algorithm: str | None,
    draft_path: str | None,
    num_steps: int | None,
    model: ModelSpec,
    field: str,
) -> DraftSize | None:
    """The draft a line's speculative flags name (SGLang's spellings; EAGLE means the model's
    MTP layer when it ships one and no draft is given, as SGLang reads it); None without one."""
    algorithm = (algorithm or "").upper()
    if num_steps is not None:
        check_speculative_steps(num_steps)
    if algorithm in ("", "NGRAM"):  # no draft model: n-gram drafts cost no memory
        return None
    tokens = (num_steps or SPEC_STEPS) + 1
    mtp = algorithm in ("NEXTN", "MTP") or (algorithm == "EAGLE" and not draft_path)
    if mtp:
        if not model.mtp_bytes:
            message = (
                f"{algorithm} drafts with the model's MTP layer; {model.name} ships none "
                "(num_nextn_predict_layers is 0 or absent): give an EAGLE-3 draft's directory"
            )
            raise TierserveError(message, field)
        return DraftSize("MTP layer", model.mtp_bytes, True, tokens, "from config.json")
    if algorithm not in ("EAGLE", "EAGLE3"):
        raise TierserveError(f"unknown speculative algorithm {algorithm!r}", field)
    if not draft_path:
        message = f"{algorithm} needs the draft's directory (--speculative-draft-model-path)"
        raise TierserveError(message, field)
    files = sorted(Path(draft_path).expanduser().glob("*.safetensors"))
    if not files:
        message = f"draft directory {draft_path} holds no *.safetensors to size the draft by"
        raise TierserveError(message, field)
    size = sum(f.stat().st_size for f in files)
    return DraftSize("EAGLE-3 draft", size, False, tokens, f"{draft_path}'s safetensors")
