"""Model classes by the `architectures` name in config.json."""

from __future__ import annotations

from tierserve.errors import TierserveError
from tierserve.models.decoder import CausalLM
from tierserve.models.deepseek import DeepseekForCausalLM
from tierserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise TierserveError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}",
            field="model",
        ) from None
