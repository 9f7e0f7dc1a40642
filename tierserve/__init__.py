"""tierserve: an LLM server whose radix KV cache spans device, host and storage."""

from typing import TYPE_CHECKING

from tierserve.errors import TierserveError
from tierserve.outputs import RequestOutput
from tierserve.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:  # for type checkers; at run time `LLM` loads torch only when asked for
    from tierserve.engine import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutput", "TierserveError"]


def __getattr__(name: str):  # keep `import tierserve` light: torch loads only when needed
    if name == "LLM":
        from tierserve.distributed import set_wait_here

        set_wait_here()  # before torch loads libgomp, which reads it once
        from tierserve.engine import LLM

        return LLM
    raise AttributeError(name)
