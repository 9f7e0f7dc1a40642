"""Model families by config.json's architecture (Llama, Mistral, Qwen, DeepSeek, Kimi-K2), EAGLE-3
draft models, DeepSeek-V3's MTP layer as a draft, and the safetensors loader."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.models.checkpoint_size import (
        checkpoint_numel,
        checkpoint_numels,
        checkpoint_sizes,
    )
    from tierserve.models.decoder import CausalLM
    from tierserve.models.dry_load import check_checkpoint
    from tierserve.models.eagle3 import (
        SHIPPED_DRAFT,
        Eagle3Config,
        Eagle3Draft,
        draft_numel,
        draft_path_for,
        load_draft,
    )
    from tierserve.models.loader import load_model, model_fingerprint
    from tierserve.models.mtp import MTPDraft, check_nextn, load_mtp, mtp_numels, nextn_layers
    from tierserve.models.quant_config import QuantConfig
    from tierserve.models.quantization import describe_backends
    from tierserve.models.registry import model_class

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "CausalLM": "decoder",
    "Eagle3Config": "eagle3",
    "Eagle3Draft": "eagle3",
    "SHIPPED_DRAFT": "eagle3",
    "check_checkpoint": "dry_load",
    "checkpoint_numel": "checkpoint_size",
    "checkpoint_numels": "checkpoint_size",
    "checkpoint_sizes": "checkpoint_size",
    "QuantConfig": "quant_config",
    "describe_backends": "quantization",
    "draft_numel": "eagle3",
    "draft_path_for": "eagle3",
    "load_draft": "eagle3",
    "MTPDraft": "mtp",
    "check_nextn": "mtp",
    "load_mtp": "mtp",
    "mtp_numels": "mtp",
    "nextn_layers": "mtp",
    "load_model": "loader",
    "model_class": "registry",
    "model_fingerprint": "loader",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
