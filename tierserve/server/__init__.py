"""The OpenAI-compatible HTTP server: its routes, the `AsyncEngine` that talks to the engine
core process, and `tierserve serve` (docs/server.md)."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.server.api import create_app
    from tierserve.server.async_engine import AsyncEngine
    from tierserve.server.cli import served_model_name

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "AsyncEngine": "async_engine",
    "create_app": "api",
    "served_model_name": "cli",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
