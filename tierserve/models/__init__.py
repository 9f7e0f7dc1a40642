"""Model families by config.json's architecture (Llama, Mistral, Qwen, DeepSeek, Kimi-K2), EAGLE-3
draft models, DeepSeek-V3's MTP layer as a draft, and the safetensors loader."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
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
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
