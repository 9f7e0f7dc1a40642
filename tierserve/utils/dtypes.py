"""The one table of element types: canonical names, widths, short names, and other spellings.

KV pools, model weights, the planner and the flags all name dtypes; each used to keep its own
table. torch is imported only by `torch_dtype`, so flag parsing and planning stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.errors import TierserveError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # canonical, torch's name where torch has the type
    bytes: int
    short: str  # the planner's and SGLang's spelling
    compute: bool  # a model may compute in it (float8 is storage only)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, "fp32", True),
        DType("bfloat16", 2, "bf16", True),
        DType("float16", 2, "fp16", True),
        DType("fp8_e4m3", 1, "fp8", False),
        DType("fp8_e5m2", 1, "fp8", False),
    )
}
# Other spellings users bring from the planner, SGLang and vLLM.
ALIASES: dict[str, str] = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
    "fp8": "fp8_e4m3",  # vLLM's name
}
COMPUTE_DTYPES = tuple(name for name, d in DTYPES.items() if d.compute)


def canonical(name: str, field: str = "dtype", what: str = "dtype") -> str:
    """The canonical name of a dtype, or a user error listing the known ones."""
    found = ALIASES.get(name, name)
    if found not in DTYPES:
        known = ", ".join([*DTYPES, *ALIASES])
        raise TierserveError(f"unknown {what} {name!r}; known: {known}", field=field)
    return found


def torch_dtype(name: str) -> torch.dtype:
    """torch's type for a canonical name; float8 pools hold bytes (torch's CPU index_copy_ has
    no float8 kernel), viewed as `float8_of` says."""
    import torch

    return getattr(torch, name) if DTYPES[name].compute else torch.uint8


def float8_of(name: str) -> torch.dtype | None:
    """The float8 type whose bytes a pool of dtype `name` holds; None for other dtypes."""
    import torch

    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(name)
