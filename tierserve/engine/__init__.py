"""The engine: start-up decisions, scheduler, model runner, the loop, the engine core process,
the offline `LLM` and the worker rank."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
    "CACHE_BYTES": "grammar",
    "CORE_MODULE": "core",
    "ENV_CLOCK_FD": "core",
    "ENV_CORE_FD": "core",
    "ENV_LOG_LEVEL": "core",
    "RequestPreparer": "prepare",
    "STEP_GATE_ENV": "core_hooks",
    "STEP_HOLD_ENV": "core_hooks",
    "INTAKE_HOLD_ENV": "core_hooks",
    "StepClock": "core_hooks",
    "Engine": "engine",
    "Grammars": "grammar",
    "LLM": "llm",
    "OutputBuilder": "output",
    "Startup": "startup",
    "check_capture_args": "hidden_states",
    "check_size": "grammar",
    "compile_spec": "grammar",
    "engine_metrics": "metrics",
    "load_tokenizer": "tokenizer",
    "new_compiler": "grammar",
    "startup_table": "kv_plan",
    "tokenizer_info": "grammar",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
