"""The engine: start-up decisions, scheduler, model runner, the loop, the offline `LLM` and the
worker rank."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
    "CACHE_BYTES": "grammar",
    "Engine": "engine",
    "Grammars": "grammar",
    "LLM": "llm",
    "OutputBuilder": "output",
    "Startup": "startup",
    "check_size": "grammar",
    "compile_spec": "grammar",
    "load_tokenizer": "engine",
    "new_compiler": "grammar",
    "startup_table": "kv_plan",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
