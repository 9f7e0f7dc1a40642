"""Model families by config.json's architecture (Llama, Mistral, Qwen, DeepSeek, Kimi-K2) and the
safetensors loader."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
    "checkpoint_numel": "loader",
    "checkpoint_numels": "loader",
    "load_model": "loader",
    "model_fingerprint": "loader",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
