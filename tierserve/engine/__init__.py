"""The engine: start-up decisions, scheduler, model runner, the loop, the engine core process,
the offline `LLM` and the worker rank. What the API process does to requests (preparing them,
building their outputs, grammars) is tierserve/frontend/, a layer below."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.engine.core import CORE_MODULE, ENV_CLOCK_FD, ENV_CORE_FD, ENV_LOG_LEVEL
    from tierserve.engine.core_hooks import INTAKE_HOLD_ENV, STEP_GATE_ENV, STEP_HOLD_ENV, StepClock
    from tierserve.engine.engine import Engine
    from tierserve.engine.hidden_states import check_capture_args
    from tierserve.engine.kv_plan import startup_table
    from tierserve.engine.llm import LLM
    from tierserve.engine.metrics import engine_metrics
    from tierserve.engine.startup import Startup

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "CORE_MODULE": "core",
    "ENV_CLOCK_FD": "core",
    "ENV_CORE_FD": "core",
    "ENV_LOG_LEVEL": "core",
    "STEP_GATE_ENV": "core_hooks",
    "STEP_HOLD_ENV": "core_hooks",
    "INTAKE_HOLD_ENV": "core_hooks",
    "StepClock": "core_hooks",
    "Engine": "engine",
    "LLM": "llm",
    "Startup": "startup",
    "check_capture_args": "hidden_states",
    "engine_metrics": "metrics",
    "startup_table": "kv_plan",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
