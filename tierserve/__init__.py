"""tierserve: an LLM server whose radix KV cache spans device, host and storage."""

from tierserve.errors import TierserveError
from tierserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TierserveError"]


def __getattr__(name: str):  # keep `import tierserve` light: torch loads only when needed
    if name in ("LLM", "RequestOutput"):
        from tierserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
